"""Part 4 of the GPU check: in-place commits under a CUDA graph and `torch.compile`, as vLLM
serves, while staging runs on another thread.

    PYTHONPATH=. python -m bench.gpu_graphs --json graphs.json        # cuda
    PYTHONPATH=. python -m bench.gpu_graphs --device cpu --small       # CI dry run

A vLLM-like forward over a stand-in's own parameters (`bench.models.vllm_layout`, Qwen3-0.6B layer
shapes, 2 layers on CUDA): embedding -> fused qkv -> fused gate_up -> down -> tied head, with
one elementwise op between matmuls (so compiled and eager round alike). It is captured once in
a CUDA graph on its own stream and compiled once (`torch.compile`, inductor); the weights are
bound to an `InPlaceSink`. Per version: a staging thread (its own stream) draws the next delta,
reading the parameters at the changed indices, while the main thread replays the graph and runs
the compiled forward; then the sink commits between replays. After each version:
- graph output == eager output, bit for bit (the graph reads the parameters' storage);
- compiled output == eager output bit for bit (`compiled_bitwise`; else within bf16 rounding,
  `compiled_max_abs_diff`), and it moved with the weights (not a stale copy);
- no recompiles (dynamo's `unique_graphs` counter does not grow).
The whole pass runs twice: with parameters made normally, then made (and served) under
`torch.inference_mode()`, as vLLM does; commits are called outside it, as a worker's RPC is.
On CPU (the dry run) there are no CUDA graphs (eager replays stand in, listed as skipped) and
`torch.compile` uses the `aot_eager` backend (inductor's C++ build is too slow for CI's cores).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Sequence

import torch
from torch import nn

from deltasync.vllm_ext.apply.inplace import InPlaceSink

from .gpu_commit import _changes, _file, _meta
from .gpu_common import part_main, shape_of
from .models.qwen3 import build_config
from .models.vllm_layout import StandInQwen3, standin_layout
from .synthetic import parameter_shapes

__all__ = ["main"]


class Harness(nn.Module):
    """embedding -> qkv -> gate_up -> down -> tied head over a stand-in's layer 0."""

    def __init__(self, standin: StandInQwen3):
        super().__init__()
        self.standin = standin
        config = standin.config
        self.hidden, self.inter = config.hidden_size, config.intermediate_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        embed = self.standin.model.embed_tokens.weight
        layer = self.standin.model.layers[0]
        h = nn.functional.embedding(ids, embed)
        a = h @ layer.self_attn.qkv_proj.weight.t()
        x = a[:, : self.hidden] + a[:, -self.hidden :]
        gu = x @ layer.mlp.gate_up_proj.weight.t()
        m = gu[:, : self.inter] * gu[:, self.inter :]
        d = m @ layer.mlp.down_proj.weight.t()
        return d @ self.standin.lm_head.weight.t()


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _pass(args, device: torch.device, inference: bool) -> dict:
    cuda = device.type == "cuda"
    shape = shape_of("qwen3-micro" if args.small else "qwen3-0.6b", layers=2, tied=True)
    config = build_config(shape)
    shapes = parameter_shapes(shape)
    gen = torch.Generator(device=device).manual_seed(1)
    made = torch.inference_mode() if inference else torch.no_grad()
    serving = torch.inference_mode if inference else torch.no_grad
    with made, torch.device(device):
        standin = StandInQwen3(config)
        for param in standin.parameters():
            param.data.copy_(torch.randn(param.shape, generator=gen).mul_(0.02))
    harness = Harness(standin)
    layout = standin_layout(config)
    sink = InPlaceSink(standin, layout)
    anchor = [_file(_meta(1, "anchor", shapes))]
    sink.commit(anchor, sink.stage(anchor))
    params = dict(standin.named_parameters(remove_duplicate=False))
    views = {
        n: params[p.param_name].data.view(-1)[p.offset : p.offset + p.box.numel]
        for n, p in layout(shapes).exact().items()
    }
    ids = torch.randint(0, config.vocab_size, (args.tokens,), generator=gen, device=device)
    stream = torch.cuda.Stream(device) if cuda else None
    on_stream = (lambda: torch.cuda.stream(stream)) if cuda else contextlib.nullcontext

    def sync() -> None:
        if cuda:
            stream.synchronize()
            torch.cuda.synchronize(device)

    torch._dynamo.reset()
    compiled = torch.compile(harness, backend="inductor" if cuda else "aot_eager")
    with serving(), on_stream():
        compiled(ids)  # compiles
        if cuda:
            harness(ids)  # warm-up on the side stream, as graph capture asks
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                static_out = harness(ids)
    sync()
    graphs_after_compile = _unique_graphs()

    def replay() -> torch.Tensor:
        with serving(), on_stream():
            if cuda:
                graph.replay()
                out = static_out.clone()
            else:
                out = harness(ids)
        sync()
        return out

    versions, previous = [], None
    for version in range(2, 2 + args.versions):
        staged: dict = {}
        staging_stream = torch.cuda.Stream(device) if cuda else None

        def stage(into=staged, s=staging_stream) -> None:
            with torch.cuda.stream(s) if cuda else contextlib.nullcontext(), torch.no_grad():
                into["changes"] = _changes(views, args.density, gen)

        thread = threading.Thread(target=stage)
        thread.start()
        replays = 0
        while thread.is_alive() or replays < 2:  # replays while staging runs
            replay()
            with serving(), on_stream():
                compiled(ids)
            replays += 1
        thread.join()
        changes = staged["changes"]
        files = [_file(_meta(version, "delta", shapes, changes), changes)]
        sink.commit(files, sink.stage(files))  # between replays, outside inference mode
        graph_out = replay()
        with serving(), on_stream():
            eager_out = harness(ids)
            compiled_out = compiled(ids)
        sync()
        diff = (compiled_out.float() - eager_out.float()).abs().max().item()
        scale = eager_out.float().abs().max().item()
        row = {
            "version": version,
            "changed": sum(c.indices.numel() for c in changes.values()),
            "replays_while_staging": replays,
            "graph_equals_eager": torch.equal(
                graph_out.view(torch.int16), eager_out.view(torch.int16)
            ),
            "compiled_bitwise": torch.equal(
                compiled_out.view(torch.int16), eager_out.view(torch.int16)
            ),
            "compiled_max_abs_diff": diff,
            "output_moved": previous is None
            or not torch.equal(eager_out.view(torch.int16), previous.view(torch.int16)),
        }
        row["compiled_matches"] = row["compiled_bitwise"] or diff <= 2**-7 * scale
        versions.append(row)
        previous = eager_out
    recompiles = _unique_graphs() - graphs_after_compile
    ok = recompiles == 0 and all(
        r["graph_equals_eager"] and r["compiled_matches"] and r["output_moved"] for r in versions
    )
    return {
        "inference_mode_params": inference,
        "cuda_graph": cuda,
        "compile_backend": "inductor" if cuda else "aot_eager",
        "graphs_compiled": graphs_after_compile,
        "recompiles": recompiles,
        "versions": versions,
        "ok": ok,
    }


def run(args, part, device: torch.device) -> bool:
    if device.type != "cuda":
        part.skip("CUDA graphs: eager replays stand in for graph replays on CPU")
        part.skip("inductor: torch.compile uses the aot_eager backend on CPU")
    passes = []
    for inference in (False, True):
        try:
            passes.append(_pass(args, device, inference))
        except Exception as exc:  # recorded; the other pass still runs
            passes.append(
                {"inference_mode_params": inference, "ok": False, "error": f"{exc!r}"[:2000]}
            )
        part.update(passes=passes)
    part.update(
        graph_equals_eager=all(
            r["graph_equals_eager"] for p in passes for r in p.get("versions", [])
        ),
        recompiles=sum(p.get("recompiles", 0) for p in passes),
    )
    return all(p["ok"] for p in passes)


def _options(p) -> None:
    p.add_argument("--versions", type=int, default=3, help="commits per pass")
    p.add_argument("--density", type=float, default=0.03, help="each delta's density")
    p.add_argument("--tokens", type=int, default=64, help="tokens per forward")


def main(argv: Sequence[str] | None = None) -> int:
    return part_main("gpu_graphs", __doc__, run, argv, _options)


if __name__ == "__main__":
    sys.exit(main())
