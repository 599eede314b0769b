"""The one conformance suite every bucket backend passes; backends plug in a `make_store` fixture.

A backend's test file subclasses `StoreConformance` and defines `make_store`: a fixture returning a
callable `name -> Store` whose stores live side by side (same parent folder or prefix) and are all
removed after the test. Nothing here is collected on its own (the class name lacks `Test`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest

from deltasync.errors import StoreError
from deltasync.store import Conflict, MissingFile, Store

MakeStore = Callable[[str], Store]

# Paths every method must refuse before touching the bucket (id -> path).
BAD_PATHS = {
    "dotdot": "..",
    "parent": "../x",
    "inner_dotdot": "a/../b",
    "absolute": "/abs",
    "double_slash": "a//b",
    "empty": "",
    "hidden": ".hidden",
    "dot": ".",
    "trailing_slash": "a/",
    "backslash": "a\\b",
    "scheme": "hf://x",
    "nul": "a\x00b",
    "too_long": "a" * 1025,
    "long_component": "a" * 201,
    "non_str_int": 1,
    "non_str_bytes": b"x",
    "non_str_none": None,
}

# Each method called on a bad path; writers carry a payload so a bug would leave a trace.
METHODS = {
    "put": lambda s, p: s.put(p, b"payload"),
    "publish": lambda s, p: s.publish(p, b"payload"),
    "swap": lambda s, p: s.swap(p, b"payload", expected=None),
    "get": lambda s, p: s.get(p),
    "get_range": lambda s, p: s.get_range(p, 0, 1),
    "size": lambda s, p: s.size(p),
    "exists": lambda s, p: s.exists(p),
    "delete": lambda s, p: s.delete(p),
}

# Prefixes `list` must refuse ('/abs' and '' are not here: list strips '/' and '' is the root).
BAD_PREFIXES = {
    k: v for k, v in BAD_PATHS.items() if k not in {"absolute", "empty", "trailing_slash"}
}

DIGITS = b"0123456789"


class StoreConformance:
    """Behaviour every `Store` backend shares."""

    # Whether racing threads may be asserted to have one winner: moto checks `If-Match` and
    # writes in two steps, so it lets racers through that S3 itself refuses.
    atomic_races = True

    @pytest.fixture
    def store(self, make_store: MakeStore) -> Store:
        return make_store("bucket")

    # put / get

    def test_put_get_round_trip(self, store: Store) -> None:
        store.put("a.bin", b"hello")
        assert store.get("a.bin") == b"hello"

    def test_get_returns_bytes(self, store: Store) -> None:
        store.put("a.bin", b"hello")
        assert type(store.get("a.bin")) is bytes
        assert type(store.get_range("a.bin", 0, 2)) is bytes

    def test_empty_object(self, store: Store) -> None:
        store.put("empty.bin", b"")
        assert store.get("empty.bin") == b""
        assert store.size("empty.bin") == 0
        assert store.exists("empty.bin")
        assert store.list() == ["empty.bin"]

    def test_large_object(self, store: Store) -> None:
        data = os.urandom(3 * 2**20 + 7)
        store.put("big.bin", data)
        assert store.size("big.bin") == len(data)
        assert store.get("big.bin") == data
        middle = len(data) // 2
        assert store.get_range("big.bin", middle, middle + 4096) == data[middle : middle + 4096]

    def test_put_accepts_bytearray_and_memoryview(self, store: Store) -> None:
        buf = bytearray(b"abc")
        store.put("ba.bin", buf)
        store.put("mv.bin", memoryview(b"xyz"))
        buf[0] = ord("Z")  # the stored copy must not follow the caller's buffer
        assert store.get("ba.bin") == b"abc"
        assert store.get("mv.bin") == b"xyz"

    def test_nested_path_round_trip(self, store: Store) -> None:
        store.put("runs/r1/deltas/000001.bin", b"d1")
        assert store.get("runs/r1/deltas/000001.bin") == b"d1"

    def test_longest_component_round_trips(self, store: Store) -> None:
        path = "a" * 200 + "/" + "b" * 200
        store.put(path, b"x")
        assert store.get(path) == b"x"
        assert store.list() == [path]

    def test_overwrite_replaces_whole_object(self, store: Store) -> None:
        store.put("a.bin", b"long old content")
        store.put("a.bin", b"new")
        assert store.get("a.bin") == b"new"
        assert store.size("a.bin") == 3
        store.put("a.bin", b"longer than before")
        assert store.get("a.bin") == b"longer than before"
        assert store.list() == ["a.bin"]

    def test_concurrent_reader_sees_old_or_new_whole(self, store: Store) -> None:
        old, new = b"o" * 65536, b"n" * 98304
        store.put("hot.bin", old)
        done, bad, reads = threading.Event(), [], [0]

        def writer() -> None:
            try:
                for i in range(20):
                    store.put("hot.bin", new if i % 2 == 0 else old)
            finally:
                done.set()

        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not done.is_set() and time.monotonic() < deadline and reads[0] < 10_000:
            got = store.get("hot.bin")
            reads[0] += 1
            if got not in (old, new):
                bad.append((len(got), got[:1], got[-1:]))
        thread.join(timeout=20)
        assert not thread.is_alive()
        assert bad == []
        assert store.get("hot.bin") == old  # the last of 20 writes

    # get_range

    @pytest.mark.parametrize(
        ("start", "end", "expected"),
        [(0, 3, b"012"), (3, 7, b"3456"), (7, 10, b"789"), (0, 10, DIGITS)],
        ids=["start", "middle", "end", "whole"],
    )
    def test_get_range(self, store: Store, start: int, end: int, expected: bytes) -> None:
        store.put("d.bin", DIGITS)
        assert store.get_range("d.bin", start, end) == expected

    def test_get_range_empty(self, store: Store) -> None:
        store.put("d.bin", DIGITS)
        assert store.get_range("d.bin", 5, 5) == b""

    def test_get_range_end_past_size_is_clamped(self, store: Store) -> None:
        store.put("d.bin", DIGITS)
        assert store.get_range("d.bin", 8, 20) == b"89"
        assert store.get_range("d.bin", 0, 100) == DIGITS

    def test_get_range_start_at_or_past_size_is_empty(self, store: Store) -> None:
        store.put("d.bin", DIGITS)
        assert store.get_range("d.bin", 10, 12) == b""
        assert store.get_range("d.bin", 20, 30) == b""

    @pytest.mark.parametrize(("start", "end"), [(5, 4), (-1, 3), (-3, -1)])
    def test_get_range_invalid_bounds(self, store: Store, start: int, end: int) -> None:
        store.put("d.bin", DIGITS)
        with pytest.raises(StoreError, match="invalid byte range"):
            store.get_range("d.bin", start, end)

    def test_get_range_missing(self, store: Store) -> None:
        with pytest.raises(MissingFile):
            store.get_range("missing.bin", 0, 4)

    # size / exists

    def test_size(self, store: Store) -> None:
        store.put("d.bin", DIGITS)
        assert store.size("d.bin") == 10

    def test_size_after_overwrite(self, store: Store) -> None:
        store.put("d.bin", DIGITS)
        assert store.size("d.bin") == 10
        store.put("d.bin", b"abc")
        assert store.size("d.bin") == 3

    def test_size_missing(self, store: Store) -> None:
        with pytest.raises(MissingFile):
            store.size("missing.bin")

    def test_exists(self, store: Store) -> None:
        store.put("d.bin", DIGITS)
        assert store.exists("d.bin")
        assert not store.exists("missing.bin")

    def test_exists_after_put_following_negative_check(self, store: Store) -> None:
        assert not store.exists("late.bin")
        store.put("late.bin", b"x")
        assert store.exists("late.bin")

    # list

    def _tree(self, store: Store) -> None:
        for path in ["top.bin", "runs/a/x.bin", "runs/a/sub/y.bin", "runs/ab/z.bin", "other/w"]:
            store.put(path, path.encode())

    def test_list_whole_bucket_sorted_relative(self, store: Store) -> None:
        self._tree(store)
        expected = ["other/w", "runs/a/sub/y.bin", "runs/a/x.bin", "runs/ab/z.bin", "top.bin"]
        assert store.list() == expected
        assert store.list("") == expected

    def test_list_prefix_nested(self, store: Store) -> None:
        self._tree(store)
        assert store.list("runs") == ["runs/a/sub/y.bin", "runs/a/x.bin", "runs/ab/z.bin"]
        assert store.list("runs/a/sub") == ["runs/a/sub/y.bin"]

    def test_list_prefix_is_a_folder_not_a_string_prefix(self, store: Store) -> None:
        self._tree(store)
        assert store.list("runs/a") == ["runs/a/sub/y.bin", "runs/a/x.bin"]
        assert store.list("run") == []

    def test_list_prefix_trailing_slash(self, store: Store) -> None:
        self._tree(store)
        assert store.list("runs/a/") == store.list("runs/a")

    def test_list_empty_bucket(self, store: Store) -> None:
        assert store.list() == []

    def test_list_missing_prefix(self, store: Store) -> None:
        self._tree(store)
        assert store.list("nope") == []
        assert store.list("runs/nope/deeper") == []

    def test_list_sees_new_and_deleted_files(self, store: Store) -> None:
        store.put("runs/a/1", b"1")
        assert store.list("runs") == ["runs/a/1"]
        store.put("runs/a/2", b"2")
        assert store.list("runs") == ["runs/a/1", "runs/a/2"]
        store.delete("runs/a/1")
        assert store.list("runs") == ["runs/a/2"]
        assert store.list() == ["runs/a/2"]

    def test_list_ignores_sibling_store_with_longer_name(self, make_store: MakeStore) -> None:
        run, run2 = make_store("run"), make_store("run2")
        run.put("x", b"1")
        run2.put("y", b"2")
        assert run.list() == ["x"]
        assert run2.list() == ["y"]
        assert not run.exists("y")

    @pytest.mark.parametrize("prefix", BAD_PREFIXES.values(), ids=BAD_PREFIXES.keys())
    def test_list_rejects_bad_prefix(self, store: Store, prefix: object) -> None:
        with pytest.raises(StoreError):
            store.list(prefix)  # type: ignore[arg-type]

    # delete

    def test_delete(self, store: Store) -> None:
        store.put("a.bin", b"1")
        store.put("b.bin", b"2")
        store.delete("a.bin")
        assert not store.exists("a.bin")
        assert store.list() == ["b.bin"]
        with pytest.raises(MissingFile):
            store.get("a.bin")

    def test_delete_missing_is_not_an_error(self, store: Store) -> None:
        store.delete("missing.bin")
        store.delete("no/such/folder/file.bin")
        assert store.list() == []

    def test_delete_twice(self, store: Store) -> None:
        store.put("a.bin", b"1")
        store.delete("a.bin")
        store.delete("a.bin")
        assert store.list() == []

    # missing files

    def test_get_missing_raises_missing_file(self, store: Store) -> None:
        with pytest.raises(MissingFile) as info:
            store.get("missing.bin")
        assert isinstance(info.value, StoreError)
        assert isinstance(info.value, FileNotFoundError)
        assert info.value.path == "missing.bin"
        assert "missing.bin" in str(info.value)

    def test_get_missing_in_missing_folder(self, store: Store) -> None:
        with pytest.raises(MissingFile):
            store.get("no/such/folder/file.bin")

    # publish

    def test_publish_round_trip(self, store: Store) -> None:
        store.publish("manifest.json", b'{"version": 1}')
        assert store.get("manifest.json") == b'{"version": 1}'
        assert store.exists("manifest.json")
        assert store.list() == ["manifest.json"]

    def test_publish_replaces(self, store: Store) -> None:
        store.publish("manifest.json", b'{"version": 1, "padding": "xxxxxxxx"}')
        store.publish("manifest.json", b'{"version": 2}')
        assert store.get("manifest.json") == b'{"version": 2}'

    # swap (the manifest's compare-and-swap commit)

    def test_swap_creates_only_when_missing(self, store: Store) -> None:
        store.swap("manifest.json", b"first", expected=None)
        assert store.get("manifest.json") == b"first"
        with pytest.raises(Conflict):
            store.swap("manifest.json", b"second", expected=None)
        assert store.get("manifest.json") == b"first"
        assert store.list() == ["manifest.json"]

    def test_swap_replaces_only_the_expected_bytes(self, store: Store) -> None:
        store.publish("manifest.json", b"v1")
        store.swap("manifest.json", b"v2", expected=b"v1")
        assert store.get("manifest.json") == b"v2"
        for stale in (b"v1", None, b"v2-but-longer", b""):
            with pytest.raises(Conflict):
                store.swap("manifest.json", b"v3", expected=stale)
        assert store.get("manifest.json") == b"v2"

    def test_swap_finding_its_own_bytes_succeeded(self, store: Store) -> None:
        """A retry after a lost answer finds the write in place: success, not a conflict."""
        store.swap("manifest.json", b"mine", expected=None)
        store.swap("manifest.json", b"mine", expected=None)
        assert store.get("manifest.json") == b"mine"

    def test_swap_is_never_retried_on_conflict(self, store: Store, monkeypatch) -> None:
        store.publish("manifest.json", b"theirs")
        slept = []
        monkeypatch.setattr(time, "sleep", slept.append)
        with pytest.raises(Conflict, match="swap"):
            store.swap("manifest.json", b"mine", expected=b"old")
        assert [s for s in slept if s >= 0.5] == []

    def test_racing_swaps_one_wins_per_round(self, store: Store) -> None:
        """Writers racing from the same base: exactly one replaces it each round (strict
        backends); a best-effort backend may let two believe they won, never a torn object."""
        store.swap("manifest.json", b"round-0", expected=None)
        wins: list[int] = []
        for round_ in range(1, 6):
            base = store.get("manifest.json")
            barrier = threading.Barrier(4)

            def write(
                writer: int, base: bytes = base, round_: int = round_, barrier=barrier
            ) -> None:
                barrier.wait(timeout=10)
                try:
                    store.swap("manifest.json", b"round-%d-w%d" % (round_, writer), expected=base)
                    wins.append(writer)
                except Conflict:
                    pass

            threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            final = store.get("manifest.json")
            assert final.startswith(b"round-%d-w" % round_)
            if store.conditional_writes and self.atomic_races:
                assert len(wins) == 1 and final == b"round-%d-w%d" % (round_, wins[0])
            wins.clear()

    # path validation

    @pytest.mark.parametrize("path", BAD_PATHS.values(), ids=BAD_PATHS.keys())
    @pytest.mark.parametrize("method", METHODS.values(), ids=METHODS.keys())
    def test_bad_path_rejected_and_nothing_written(
        self, store: Store, method: Callable[[Store, object], object], path: object
    ) -> None:
        with pytest.raises(StoreError, match="invalid bucket path"):
            method(store, path)
        assert store.list() == []
