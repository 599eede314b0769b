"""`StoredFile`: a file's header read by range, its bytes in pieces within a window, checked."""

from __future__ import annotations

import threading

import pytest
import torch
import xxhash

from deltasync.codec import encode_anchor
from deltasync.errors import FormatError
from deltasync.store import LocalStore
from deltasync.wire import stored
from deltasync.wire.stored import ByteRange, StoredFile

PIECE = 4096


class WatchedStore(LocalStore):
    """Counts the bytes asked for and the reads running at once."""

    range_bytes = PIECE

    def __init__(self, folder):
        super().__init__(folder)
        self.asked, self.running, self.most = 0, 0, 0
        self._lock = threading.Lock()

    def get_range(self, path, start, end):
        with self._lock:
            self.asked += end - start
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            return super().get_range(path, start, end)
        finally:
            with self._lock:
                self.running -= 1


@pytest.fixture
def file(tmp_path, monkeypatch):
    monkeypatch.setattr(stored, "HEAD_BYTES", 1024)
    tensors = {f"t{i}": torch.randn(6000 * (i + 1)).to(torch.bfloat16) for i in range(4)}
    data = encode_anchor(tensors, run_id="r", version=1)
    (tmp_path / "f.safetensors").write_bytes(data)
    return WatchedStore(tmp_path), data


def _open(store, data, **changes):
    fields = {"size": len(data), "digest": xxhash.xxh3_128_hexdigest(data)} | changes
    return StoredFile.open(store, "f.safetensors", fields["size"], fields["digest"])


def test_a_stream_gives_every_byte_in_order_within_the_window(file):
    store, data = file
    found = _open(store, data)
    window = 3 * PIECE
    got = bytearray()
    for at, piece in found.stream(window=window):
        assert at == len(got)
        got += piece
    assert bytes(got) == data
    assert store.most <= window // PIECE - 1  # with the piece being consumed: the window
    assert store.asked == len(data) + 1  # the head once, the rest once, one byte past the end


def test_ranges_are_read_on_their_own_and_aligned(file):
    store, data = file
    found = _open(store, data)
    store.asked = 0
    ranges = [ByteRange(20000, 30000, align=3000), ByteRange(500, 700)]
    pieces = list(found.pieces(ranges, window=4 * PIECE))
    assert [at for at, _ in pieces] == sorted(at for at, _ in pieces)
    for at, piece in pieces:
        assert piece == data[at : at + len(piece)]
        if at >= 20000:
            assert ((at - 20000) % 3000 == 0 and len(piece) % 3000 == 0) or at + len(piece) == 30000
    assert store.asked == 10000  # 500..700 lies in the head, which is not read again


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("longer", "larger than the"),
        ("shorter", "truncated"),
        ("flipped", "digest differs"),
    ],
)
def test_a_file_that_is_not_what_the_manifest_says_is_refused(file, tmp_path, change, message):
    store, data = file
    found = _open(store, data)
    path = tmp_path / "f.safetensors"
    body = bytearray(data)
    if change == "longer":
        body += b"x"
    elif change == "shorter":
        del body[-10:]
    else:
        body[-5] ^= 1
    path.write_bytes(bytes(body))
    with pytest.raises(FormatError, match=message):
        for _ in found.stream(window=3 * PIECE):
            pass


def test_a_header_of_garbage_is_refused_from_the_head_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(stored, "HEAD_BYTES", 1024)
    garbage = bytes(range(256)) * 4096
    (tmp_path / "f.safetensors").write_bytes(garbage)
    store = WatchedStore(tmp_path)
    with pytest.raises(FormatError, match="header size"):
        _open(store, garbage)
    assert store.asked == 1024
