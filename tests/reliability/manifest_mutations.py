"""Hypothesis strategies that mutate a real manifest: bytes, fields, entry paths, entry lists."""

from __future__ import annotations

import copy
import json

from hypothesis import strategies as st
from mutations import HUGE, JSON_SCALARS, JSON_VALUES, RAW_TOKENS

# Manifest entry paths that must never be read: outside the bucket, in another run, not a file
# of this chain, or not a plain object name at all.
HOSTILE_PATHS = {
    "parent": "../manifest.json",
    "deep_parent": "../../../../etc/passwd",
    "inner_parent": "runs/run/deltas/../../../secret",
    "absolute": "/etc/passwd",
    "home": "~/.cache/huggingface/token",
    "url_https": "https://example.com/x.safetensors",
    "url_hf": "hf://buckets/someone/else/runs/run/deltas/00000002-000000000000.safetensors",
    "url_s3": "s3://other-bucket/x.safetensors",
    "url_file": "file:///etc/passwd",
    "backslash": "runs\\run\\deltas\\00000002-000000000000.safetensors",
    "windows_drive": "C:\\Windows\\win.ini",
    "nul": "runs/run/deltas/00000002\x00.safetensors",
    "newline": "runs/run/deltas/x\n.safetensors",
    "hidden": "runs/run/deltas/.tmp-upload",
    "percent": "runs/run/deltas/%2e%2e/x.safetensors",
    "double_slash": "runs//run/deltas/x.safetensors",
    "trailing_slash": "runs/run/deltas/",
    "empty": "",
    "non_ascii": "runs/r\u00fcn/deltas/x.safetensors",
    "other_run": "runs/other-run/deltas/00000002-000000000000.safetensors",
    "manifest_itself": "manifest.json",
    "metrics_record": "runs/run/metrics/00000002.json",
    "outside_runs": "secrets/token.txt",
    "wrong_folder": "runs/run/anchors/00000002-000000000000.safetensors",
}


def _json_bytes_mutation(draw, raw: bytes) -> bytes:
    data = bytearray(raw)
    kind = draw(st.sampled_from(["flip", "overwrite", "truncate", "extend"]))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 6))):
            data[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
    elif kind == "overwrite":
        at = draw(st.integers(0, len(data) - 1))
        chunk = draw(st.binary(min_size=1, max_size=12))
        data[at : at + len(chunk)] = chunk
    elif kind == "truncate":
        del data[draw(st.integers(0, len(data) - 1)) :]
    else:
        data += draw(st.binary(min_size=1, max_size=32))
    return bytes(data)


ENTRY_VALUES = {
    "version": st.one_of(st.integers(-2, 12), st.sampled_from([*HUGE, True, 1.0, "3"])),
    "kind": st.sampled_from(["anchor", "delta", "Anchor", "", None, 1]),
    "path": st.one_of(st.sampled_from(sorted(HOSTILE_PATHS.values())), st.text(max_size=20)),
    "bytes": st.one_of(st.integers(-2, 10**6), st.sampled_from([*HUGE, None, "12"])),
    "digest": st.one_of(st.sampled_from(["", "0" * 32, "../x", None, 7]), st.text(max_size=34)),
    "encoding": st.sampled_from(["packed", "coo", "full", "pickle", "", None]),
    "changed_elements": st.one_of(st.integers(-2, 10**4), st.sampled_from([*HUGE, None])),
    "state_digest": st.one_of(
        st.sampled_from(["0" * 32, "f" * 32, "F" * 32, "", None, 7, "0" * 31]),
        st.text(alphabet="0123456789abcdef", min_size=32, max_size=32),
    ),
}


@st.composite
def manifest_mutation(draw, raw: bytes) -> bytes:
    """A manifest with bytes, a top-level field, an entry field, a path or the entry lists
    changed (once or twice)."""
    out = raw
    for _ in range(draw(st.integers(1, 2))):
        out = _manifest_once(draw, out)
    return out


def _manifest_once(draw, raw: bytes) -> bytes:
    kind = draw(st.sampled_from(["bytes", "top", "entry", "path", "lists", "raw_token", "whole"]))
    try:
        doc = json.loads(raw)
        json.dumps(copy.deepcopy(doc))  # nesting shallow enough to edit again
    except (ValueError, RecursionError):
        doc = None
    if kind == "bytes" or not isinstance(doc, dict) or not raw:
        return _json_bytes_mutation(draw, raw) if raw else draw(st.binary(max_size=32))
    if kind == "whole":
        return json.dumps(draw(JSON_VALUES)).encode()
    if kind == "top":
        key = draw(st.sampled_from([*sorted(doc), "extra"]))
        if key in doc and draw(st.booleans()):
            del doc[key]
        else:
            doc[key] = draw(st.one_of(JSON_VALUES, st.sampled_from([*HUGE, -1, 0, 1e400])))
        return json.dumps(doc).encode()
    lists = [k for k in ("anchors", "deltas") if isinstance(doc.get(k), list) and doc[k]]
    if not lists:
        return json.dumps(doc).encode()
    name = draw(st.sampled_from(lists))
    items = doc[name]
    at = draw(st.integers(0, len(items) - 1))
    if kind in ("entry", "path") and isinstance(items[at], dict):
        field = "path" if kind == "path" else draw(st.sampled_from([*ENTRY_VALUES, "extra"]))
        if field != "extra" and field in items[at] and draw(st.integers(0, 5)) == 0:
            del items[at][field]
        else:
            items[at][field] = draw(ENTRY_VALUES.get(field, JSON_SCALARS))
    elif kind == "lists":
        action = draw(st.sampled_from(["duplicate", "drop", "reverse", "swap_lists", "clear"]))
        if action == "duplicate":
            items.insert(at, copy.deepcopy(items[at]))
        elif action == "drop":
            del items[at]
        elif action == "reverse":
            items.reverse()
        elif action == "swap_lists":
            other = "deltas" if name == "anchors" else "anchors"
            if isinstance(doc.get(other), list):
                doc[other].append(items.pop(at))
        else:
            items.clear()
    else:  # raw JSON text no encoder writes: deep nesting or a number too long to parse
        marker = "@@RAW@@"
        items[at] = marker
        return json.dumps(doc).replace(f'"{marker}"', draw(RAW_TOKENS)).encode()
    return json.dumps(doc).encode()
