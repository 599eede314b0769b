"""The bucket's two digests, torch-free at import (bucket readers need no torch).

Content digests: xxh3-128 of files (the manifest's `digest`) and of tensors' bf16 bytes
(~10 GB/s, run on every sync).

The full-state digest `cubesum-4x31`: a sum over elements, so it composes across shards and
updates in O(changed). Here are the value type, the keys and the text form (kernels:
`deltasync.kernels.state_hash`).

Per lane l (four lanes, primes p_l = 2^31 - k_l with k = 69, 99, 105, 159, each = 2 mod 3), per
tensor name N and element at flat row-major index i with bf16 bit pattern w (unsigned, 0..65535):

    x = (a * (i mod 2^31) + a_hi * (i div 2^31) + g + b * (w + 1)) mod p_l,    h = x^3 mod p_l

with keys a, a_hi, g, b in [1, p_l - 1] from `tensor_keys(N)`. A tensor's digest is the sum of
h over its elements mod p_l (so any partition of the elements sums to it), the state's the sum
over its tensors. Changing one element always changes every lane: b * (w' - w) != 0 mod p_l and
cubing is a bijection mod p_l (gcd(3, p_l - 1) = 1). Two states whose index/value moments up to
degree 3 differ collide with probability at most (3/p)^4 < 2^-118 over the keys (Schwartz-Zippel
per lane): a guard against accidental divergence, not against an attacker (the manifest's file
digests and the auth are).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from deltasync.errors import FormatError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALGORITHM",
    "DIGEST_ALGORITHM",
    "LANE_K",
    "PRIMES",
    "StateDigest",
    "bytes_digest",
    "tensor_digest",
    "tensor_keys",
    "total",
]

ALGORITHM = "cubesum-4x31"
DIGEST_ALGORITHM = "xxh3-128"
LANE_K = (69, 99, 105, 159)
PRIMES = tuple((1 << 31) - k for k in LANE_K)
_HEX = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class StateDigest:
    """One value per lane; digests of disjoint parts add up (mod each prime)."""

    lanes: tuple[int, int, int, int]

    @classmethod
    def zero(cls) -> StateDigest:
        return cls((0, 0, 0, 0))

    @classmethod
    def of(cls, values: Iterable[int]) -> StateDigest:
        """Reduce raw per-lane sums (any integers) mod each lane's prime."""
        return cls(tuple(int(v) % p for v, p in zip(values, PRIMES, strict=True)))  # type: ignore[arg-type]

    @classmethod
    def parse(cls, text: object, *, path: str | None = None) -> StateDigest:
        """The 32-hex-digit text form (8 per lane, lane 0 first); raises `FormatError`."""
        if not isinstance(text, str) or not _HEX.fullmatch(text):
            raise FormatError(f"state digest {text!r} is not 32 lowercase hex digits", path=path)
        lanes = tuple(int(text[8 * i : 8 * i + 8], 16) for i in range(4))
        if any(v >= p for v, p in zip(lanes, PRIMES, strict=True)):
            raise FormatError(f"state digest {text!r} has a lane past its prime", path=path)
        return cls(lanes)  # type: ignore[arg-type]

    def __add__(self, other: StateDigest) -> StateDigest:
        return StateDigest.of(a + b for a, b in zip(self.lanes, other.lanes, strict=True))

    def __sub__(self, other: StateDigest) -> StateDigest:
        return StateDigest.of(a - b for a, b in zip(self.lanes, other.lanes, strict=True))

    def hex(self) -> str:
        return "".join(f"{v:08x}" for v in self.lanes)

    def __str__(self) -> str:
        return self.hex()


def total(sums: Mapping[str, StateDigest] | Iterable[StateDigest]) -> StateDigest:
    """The digest of a whole state from its tensors' (or a tensor's from its parts')."""
    values = sums.values() if isinstance(sums, Mapping) else sums
    lanes = zip((0, 0, 0, 0), *(d.lanes for d in values), strict=True)  # each lane's values
    return StateDigest.of(map(sum, lanes))


@functools.lru_cache(maxsize=1 << 16)
def tensor_keys(name: str) -> tuple[tuple[int, int, int, int], ...]:
    """Per lane (a, a_hi, g, b) for a tensor name: xxh3-64 of the UTF-8 name with seed
    4 * lane + j (j = 0..3), reduced to [1, p - 1]."""
    data = name.encode("utf-8")
    return tuple(
        tuple(xxhash.xxh3_64_intdigest(data, seed=4 * lane + j) % (p - 1) + 1 for j in range(4))  # type: ignore[misc]
        for lane, p in enumerate(PRIMES)
    )


def tensor_digest(tensor: torch.Tensor) -> str:
    """Hex xxh3-128 of a CPU tensor's raw bytes in row-major order (no copy when contiguous)."""
    import torch  # the caller holds a tensor, so torch is loaded already

    flat = tensor.detach().reshape(-1).contiguous()  # a no-op when contiguous already
    return xxhash.xxh3_128_hexdigest(flat.view(torch.uint8).numpy())


def bytes_digest(data: bytes | memoryview) -> str:
    """Hex xxh3-128 of a byte string (used for whole files in the manifest)."""
    return xxhash.xxh3_128_hexdigest(data)
