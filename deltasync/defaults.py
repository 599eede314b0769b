"""The one block of defaults for every Python part that has deltasync (stdlib only, layer 0).

`trainer/defaults.py` reads it. The Space images keep their own literals (a Dockerfile and a
shell entrypoint cannot import Python); tests/deltasync/test_defaults.py checks they agree, and
that README's table names every `DELTASYNC_*` variable the parts read.
"""

from __future__ import annotations

# The publisher's anchor policy (`wire.policy.AnchorPolicy`).
ANCHOR_INTERVAL = 50  # a full anchor every N versions after the last one
MAX_DELTA_FRACTION = 0.5  # ... or once the deltas since it add up to this share of an anchor
KEEP_ANCHORS = 2  # anchors retained in the bucket

# The publisher's delta encoding (`codec`): `ctx` codes each change in the context of its base
# element's exponent, about 0.7x the bytes of `ans` (BENCHMARKS.md).
ENCODING = "ctx"

# The replica.
RECOMPUTE_EVERY = 50  # the full-state digest recomputed from the held bytes every N versions
PAUSE_DEADLINE_S = 90.0  # longest pause of generation for one sync
FOLLOW_INTERVAL_S = 2.0  # a following replica's manifest polls
STAGE_TIMEOUT_S = 900.0  # longest wait for one version's staging (generation is not paused)
STARTUP_TIMEOUT_S = 900.0  # a server's longest start to healthy (a large model loads slowly)

# Every reader: how many bytes of a file it has in flight at once (anchors are read in pieces of
# `Store.range_bytes`, never whole), beside what it holds.
READ_WINDOW_BYTES = 128 * 1024 * 1024

# Where the local parts listen (loopback only); replica i listens on VLLM_PORT + 10 * i.
HOST = "127.0.0.1"
VLLM_PORT = 8001
ENV_PORT = 8002
DASHBOARD_PORT = 7860
SPACE_PORT = 7860  # every Space serves here (Hugging Face's default app_port)
