"""One side of a publisher race, run in its own process (`multiprocessing` spawn).

Each round both sides wait at a barrier, then take the run over (`takeover=True`) and publish one
version of their own states; every outcome goes to the parent: the version and full-state digest
committed, the one-line error of the side that lost, or any other exception (a bug).
"""

from __future__ import annotations

import logging
from typing import Any

from wire_samples import RUN, base_state, stepped

from deltasync.errors import PublishError
from deltasync.kernels.state_hash import full_state_digest
from deltasync.publisher.publisher import Publisher, PublisherConfig
from deltasync.store import LocalStore
from deltasync.wire.policy import AnchorPolicy

POLICY = AnchorPolicy(interval=10, max_delta_fraction=None, keep_anchors=1)


def race(side: int, bucket: str, rounds: int, barrier: Any, results: Any) -> None:
    logging.disable(logging.CRITICAL)  # the losers' errors come back through `results`
    state = base_state(side)
    for round_ in range(rounds):
        state = stepped(state, 1000 * side + round_)
        barrier.wait(timeout=120)
        publisher = Publisher(
            LocalStore(bucket), PublisherConfig(RUN, policy=POLICY, takeover=True)
        )
        try:
            record = publisher.publish(state).result(timeout=120)
        except PublishError as exc:
            results.put((round_, side, "lost", str(exc)))
        except Exception as exc:  # reported, so the parent fails at once with the cause
            results.put((round_, side, "crashed", repr(exc)))
            raise
        else:
            digest = full_state_digest(state).hex()
            results.put((round_, side, "committed", (record.version, digest)))
        finally:
            publisher.close(timeout=60)
