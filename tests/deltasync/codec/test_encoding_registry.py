"""The encoding registry: every delta encoding the wire knows has a codec (and no codec lacks a
wire entry), the protocol that introduced an encoding gates it, a tag registers once, and no
product code switches on an encoding's name (`wire.encodings` and `codec.registry` say what
each one is)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import safetensors.torch
import torch

import deltasync.codec.files  # noqa: F401  (its codecs register on import)
from deltasync.codec import ENCODINGS, ParsedFile
from deltasync.codec.registry import _CODECS, codec_of, register_codec
from deltasync.errors import FormatError
from deltasync.wire.encodings import Encoding, register, spec_of, tags

REPO = Path(__file__).resolve().parents[3]
FIXTURES_3 = REPO / "tests" / "fixtures" / "protocol-3"
FIXTURES_5 = REPO / "tests" / "fixtures" / "protocol-5"


def test_every_delta_encoding_has_one_codec_and_writers_choose_among_them():
    assert set(_CODECS) == set(tags("delta")) == set(ENCODINGS)
    assert tags("anchor") == ("full", "virtual")
    for tag in ENCODINGS:
        codec = codec_of(tag)
        assert codec.wire is spec_of(tag) and codec.wire.kind == "delta"
        assert len(codec.wire.suffixes) == len(codec.wire.dtypes) >= 1
    with pytest.raises(FormatError, match="no codec for encoding 'full'"):
        codec_of("full")


def test_a_tag_registers_once_and_a_codec_needs_a_delta_wire_entry():
    with pytest.raises(ValueError, match="registered already"):
        register(Encoding("coo", "delta", 1, suffixes=(".x",), dtypes=("U8",)))
    with pytest.raises(ValueError, match="suffixes and dtypes"):
        Encoding("odd", "delta", 1, suffixes=(".x",), dtypes=())
    with pytest.raises(ValueError, match="a codec is for a delta encoding"):
        register_codec("full", encode=None, decode=None)
    with pytest.raises(FormatError, match="unknown encoding 'zip'; known: ans, ctx"):
        spec_of("zip")


@pytest.mark.parametrize(
    "fixture, encoding, fmt",
    [
        (FIXTURES_5 / "bucket-ans", "ctx", "deltasync_ctx"),  # ctx came with protocol 6
        (FIXTURES_3 / "bucket-sharded-packed", "ans", "deltasync_ans"),  # ans with protocol 4
    ],
)
def test_a_file_naming_an_encoding_newer_than_its_protocol_is_refused(fixture, encoding, fmt):
    delta = next(p for p in fixture.rglob("00000002*.safetensors"))
    parsed = ParsedFile.parse(delta.read_bytes())
    assert spec_of(encoding).since_protocol > int(parsed.header.metadata["protocol"][-1])
    metadata = parsed.header.metadata | {"encoding": encoding, "format": fmt}
    blob = safetensors.torch.save(safetensors.torch.load(delta.read_bytes()), metadata=metadata)
    with pytest.raises(FormatError, match="encoding"):
        ParsedFile.parse(blob)


def _switches_on_a_tag(node: ast.Compare, source: str) -> bool:
    """`<something with encoding in its name> ==/!=/in <a registered tag or tags>`."""
    known = set(tags("delta")) | set(tags("anchor"))
    sides = [node.left, *node.comparators]
    named = [ast.get_source_segment(source, side) or "" for side in sides]
    literals = set()
    for side in sides:
        values = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
        literals |= {v.value for v in values if isinstance(v, ast.Constant)}
    return bool(literals & known) and any("encoding" in text for text in named)


def test_no_product_code_switches_on_an_encoding_name():
    found = []
    for path in sorted((REPO / "deltasync").rglob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Compare) and _switches_on_a_tag(node, source):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == [], found


def test_a_codec_that_codes_against_the_base_is_refused_without_it():
    from deltasync.codec import encode_delta
    from deltasync.kernels.state_hash import full_state_digest
    from deltasync.publisher.snapshot import Bf16Snapshot

    old = {"w": torch.zeros(64, dtype=torch.bfloat16)}
    new = {"w": torch.ones(64, dtype=torch.bfloat16)}
    diff = Bf16Snapshot(old).diff(new)
    for tag in ENCODINGS:
        kwargs = {"run_id": "run", "version": 2, "base_version": 1, "encoding": tag}
        kwargs["state_digest"] = full_state_digest(new)
        if codec_of(tag).needs_base:
            with pytest.raises(ValueError, match=f"the {tag} encoding codes against the base"):
                encode_delta(diff, **kwargs)
        assert encode_delta(diff, **kwargs, base=old)  # every codec takes the base
