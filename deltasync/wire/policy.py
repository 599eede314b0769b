"""When to write a full anchor: a fixed interval and/or a bound on a cold start's bytes."""

from __future__ import annotations

from dataclasses import dataclass

from deltasync import defaults
from deltasync.wire.manifest import Manifest

__all__ = ["AnchorPolicy"]


@dataclass(frozen=True)
class AnchorPolicy:
    """Anchor at the first version, then whenever either rule fires.

    Attributes:
        interval: anchor every `interval` versions after the last anchor (None: off).
        max_delta_fraction: anchor once the deltas since the last anchor add up to this fraction
            of an anchor's size, so a cold start never downloads more than about
            (1 + fraction) anchors (None: off).
        keep_anchors: anchors retained in the bucket; older anchors and the deltas before the
            oldest retained anchor are deleted once a newer manifest commits.
    """

    interval: int | None = defaults.ANCHOR_INTERVAL
    max_delta_fraction: float | None = defaults.MAX_DELTA_FRACTION
    keep_anchors: int = defaults.KEEP_ANCHORS

    def __post_init__(self) -> None:
        if self.interval is not None and self.interval < 1:
            raise ValueError(f"interval must be >= 1 or None, got {self.interval}")
        if self.max_delta_fraction is not None and not self.max_delta_fraction > 0:
            raise ValueError(
                f"max_delta_fraction must be > 0 or None, got {self.max_delta_fraction}"
            )
        if self.keep_anchors < 1:
            raise ValueError(f"keep_anchors must be >= 1, got {self.keep_anchors}")

    def wants_anchor(self, manifest: Manifest | None, version: int) -> bool:
        if manifest is None:
            return True
        last = manifest.latest_anchor
        if self.interval is not None and version - last.version >= self.interval:
            return True
        since = sum(d.bytes for d in manifest.deltas_after(last.version))
        return self.max_delta_fraction is not None and since >= self.max_delta_fraction * last.bytes
