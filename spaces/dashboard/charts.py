"""Vega-Lite specs for the five charts, built from plain series rows (no plotting library).

Gradio's `gr.Plot` renders a Vega-Lite spec handed to it as `AltairPlotData`, which gives what
its native plots lack here: a log scale, layers (anchor marks, the full-model line) and two y
axes. With `chart="line"` Gradio sizes the chart to its box and applies the theme, recolouring
each layer's colour scale: so every spec here is layered, every layer has an encoding and every
colour encoding names its scale's domain and range. The SVG renderer keeps the marks in the DOM,
where a headless browser (and a screen reader, through the aria labels) can read them.
"""

from __future__ import annotations

import json
from typing import Any

from gradio.components.plot import AltairPlotData

__all__ = [
    "latency_chart",
    "payload_chart",
    "reward_chart",
    "sparsity_chart",
    "timing_chart",
    "to_plot",
]

_HEIGHT = 240
_PALETTE = ["#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#eeca3b", "#b279a2", "#ff9da6"]
# Gradio's theme strokes every mark in the accent colour; points keep their series colour.
_POINT = {"filled": True, "size": 36, "strokeOpacity": 0}


def _axis(field: str, title: str | None = None, **extra: Any) -> dict[str, Any]:
    """A quantitative position encoding of `field` (titled `title`, else the field's name)."""
    return {"field": field, "type": "quantitative", "title": title or field, **extra}


_VERSION = _axis("version", axis={"format": "d", "tickMinStep": 1})


def _line(y: dict[str, Any], color: dict[str, Any], tips: list, **mark: Any) -> dict[str, Any]:
    """A layer of points joined by a line, over the versions unless `mark` has an `x`."""
    x = mark.pop("x", _VERSION)
    encoding = {"x": x, "y": y, "color": color, "tooltip": tips}
    return {"mark": {"type": "line", "point": _POINT, **mark}, "encoding": encoding}


def to_plot(spec: dict[str, Any]) -> AltairPlotData:
    return AltairPlotData(plot=json.dumps(spec), chart="line")


def sparsity_chart(versions: list[dict[str, Any]]) -> dict[str, Any]:
    """Sparsity (left axis) and changed elements (right axis) of each delta."""
    rows = [r for r in versions if r["sparsity"] is not None]
    if not rows:
        return _placeholder("Sparsity per version", "no deltas yet")
    names = ["sparsity", "changed elements"]
    tips = _tips("version", "sparsity", "changed_elements")
    return _chart(
        "Sparsity and changed elements per delta",
        rows,
        [
            _line(
                _axis("sparsity", axis={"format": ".1%"}, scale={"zero": False}),
                _color({"datum": names[0]}, names),
                tips,
            ),
            _line(
                _axis("changed_elements", "changed elements", axis={"format": "~s"}),
                _color({"datum": names[1]}, names),
                tips,
                strokeDash=[4, 3],
            ),
        ],
        resolve={"scale": {"y": "independent"}},
    )


def payload_chart(versions: list[dict[str, Any]]) -> dict[str, Any]:
    """Bytes per sync on a log scale: deltas, anchors marked, the full bf16 model as a rule."""
    points = [
        {"version": r["version"], "file": kind, "bytes": r[f"{kind}_bytes"]}
        for r in versions
        for kind in ("delta", "anchor")
        if r[f"{kind}_bytes"]
    ]
    if not points:
        return _placeholder("Payload bytes per sync", "no files yet")
    full = max((r["full_bytes"] or 0 for r in versions), default=0)
    names = ["delta", "anchor", "full bf16 model"]
    log_y = _axis("bytes", "bytes (log scale)", scale={"type": "log"}, axis={"format": "~s"})
    tips = _tips("version", "file", "bytes")
    layer: list[dict[str, Any]] = [
        {
            "transform": [{"filter": "datum.file === 'anchor'"}],
            "mark": {"type": "rule", "strokeDash": [2, 3], "opacity": 0.6},
            "encoding": {"x": _VERSION, "color": _color({"field": "file"}, names)},
        },
        {
            "transform": [{"filter": "datum.file === 'delta'"}],
            **_line(log_y, _color({"field": "file"}, names), tips),
        },
        {
            "transform": [{"filter": "datum.file === 'anchor'"}],
            "mark": {
                "type": "point",
                "shape": "diamond",
                "size": 110,
                "filled": True,
                "opacity": 1,
                "strokeOpacity": 0,
            },
            "encoding": {
                "x": _VERSION,
                "y": log_y,
                "color": _color({"field": "file"}, names),
                "tooltip": tips,
            },
        },
    ]
    if full:
        layer.append(
            {
                "data": {"values": [{"bytes": full, "file": names[2]}]},
                "mark": {"type": "rule", "strokeWidth": 2},
                "encoding": {
                    "y": log_y,
                    "color": _color({"field": "file"}, names),
                    "tooltip": _tips("file", "bytes"),
                },
            }
        )
    return _chart("Payload bytes per sync vs the full bf16 model (anchors dashed)", points, layer)


def timing_chart(rows: list[dict[str, Any]], from_replicas: bool) -> dict[str, Any]:
    """Seconds per sync, one line per series (replica stage/pause/apply, or trainer timings)."""
    title = (
        "Sync time vs inference pause per replica (s)"
        if from_replicas
        else "Trainer encode / upload (s): replicas have not reported timings"
    )
    return _seconds_lines(title, rows, "no metrics records yet")


def latency_chart(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Commit-to-serving latency per version, one line per replica."""
    title = "Commit-to-serving latency per replica (s)"
    return _seconds_lines(title, rows, "the metrics records carry no latency yet")


def _seconds_lines(title: str, rows: list[dict[str, Any]], empty: str) -> dict[str, Any]:
    """Seconds per version, one line per series; a placeholder saying `empty` without rows."""
    if not rows:
        return _placeholder(title, empty)
    names = sorted({r["series"] for r in rows})
    return _chart(
        title,
        rows,
        [
            _line(
                _axis("seconds"),
                _color({"field": "series"}, names),
                _tips("version", "series", "seconds"),
            )
        ],
    )


def reward_chart(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return _placeholder("Reward per step", "the metrics records carry no reward yet")
    names = ["mean reward"]
    return _chart(
        "Reward per step",
        rows,
        [
            _line(
                _axis("reward", "mean reward", scale={"zero": False}),
                _color({"datum": names[0]}, names),
                _tips("step", "version", "reward"),
                x=_axis("step", axis={"format": "d", "tickMinStep": 1}),
            )
        ],
    )


def _chart(
    title: str, values: list[dict[str, Any]], layer: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    return {
        "$schema": "https://vega.github.io/schema/vega-lite/v5.json",
        "title": title,
        "height": _HEIGHT,
        "data": {"values": values},
        "layer": layer,
        "usermeta": {"embedOptions": {"renderer": "svg", "actions": False}},
        **extra,
    }


def _placeholder(title: str, message: str) -> dict[str, Any]:
    text = {"type": "text", "fontSize": 14, "color": "#888", "strokeOpacity": 0}
    return _chart(
        title, [{"message": message}], [{"mark": text, "encoding": {"text": {"field": "message"}}}]
    )


def _color(source: dict[str, str], names: list[str]) -> dict[str, Any]:
    """A nominal colour encoding with an explicit domain and range (Gradio recolours ranges)."""
    domain = list(names)
    palette = [_PALETTE[i % len(_PALETTE)] for i in range(len(domain))]
    return {
        **source,
        "type": "nominal",
        "title": None,
        "scale": {"domain": domain, "range": palette},
        "legend": {"orient": "bottom"},
    }


def _tips(*fields: str) -> list[dict[str, str]]:
    nominal = {"file", "series"}
    return [{"field": f, "type": "nominal" if f in nominal else "quantitative"} for f in fields]
