"""Replaying a chain: the one loop by which every reader walks the files of a plan.

Two modes. Streaming (the default) applies one file at a time: a sharded trainer's resume, and
`verify` past its first anchor. All or nothing stages every file, each fetched as staging reaches
it, then commits them together, so a failure anywhere leaves the reader as it was: a replica
catching up (`Replica.sync`), `export`, `replay`; a vLLM worker stages while it serves
(`fetch_all`) and commits later, in the pause. Staged after an anchor, a delta is written into
the anchor's tensors as it decodes (`Replica`), so a cold start holds one state, not a state and
its deltas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from deltasync.store import Store
from deltasync.wire.manifest import ChainEntry, FileData, fetch_entry

__all__ = ["Fetch", "Reader", "bounded_by", "fetch_all", "replay"]

Fetch = Callable[[Store, ChainEntry], FileData]


class Reader(Protocol):
    """What a replay feeds: `Replica`, or a trainer rank's rows (`publisher.shards`)."""

    def update(self, data: FileData, *, path: str | None = None) -> Any: ...


def bounded_by(reader: Any) -> Fetch:
    """`fetch_entry` bounded by the model the reader holds when each file is fetched (a
    `Replica`'s sink; nothing before its first anchor), so a manifest declaring more bytes
    than that model can take is refused before the read."""
    sink = getattr(reader, "sink", None)
    return lambda store, entry: fetch_entry(store, entry, shapes=sink and sink.shapes())


def fetch_all(
    store: Store, plan: Iterable[ChainEntry], fetch: Fetch = fetch_entry
) -> Iterator[tuple[FileData, str]]:
    """Every file of `plan`, fetched (and size-checked by `fetch`) as it is asked for, with
    its label: a reader staging them one after the other holds one file's bytes at a time."""
    return ((fetch(store, entry), entry.label) for entry in plan)


def replay(
    store: Store,
    plan: Sequence[ChainEntry] | Iterable[ChainEntry],
    reader: Reader,
    *,
    streaming: bool = True,
    fetch: Fetch | None = None,
    after: Callable[[ChainEntry], None] | None = None,
) -> list[int]:
    """Apply the files of `plan` to `reader` in order; returns the versions applied.

    `streaming=False` needs a reader with `stage` and `commit` (a `Replica`): nothing
    changes unless every file applies. `fetch` defaults to `bounded_by(reader)`. `after` runs
    after each file in streaming mode (e.g. `verify`'s check of a retained anchor against the
    replay).
    """
    fetch = fetch or bounded_by(reader)
    if not streaming:
        return reader.commit(reader.stage(fetch_all(store, plan, fetch)))  # type: ignore[attr-defined]
    applied = []
    for entry in plan:
        reader.update(fetch(store, entry), path=entry.label)
        applied.append(entry.version)
        if after is not None:
            after(entry)
    return applied
