"""`train.compile`: torch.compile of the model (whole, or per transformer block), its cache in the run directory, its checks.

    meshrun train examples/configs/tiny.toml --set train.compile=true     # or "auto": eager if it fails

Where the parameters are plain tensors (one process, DDP) the whole model (embedding, blocks,
last norm, head) is one `fullgraph=True` graph: fewer calls into compiled code, and inductor
fuses across the block boundaries (`whole_model_allows`). DDP wraps the compiled model, so its
gradient hooks run as in eager. Under FSDP, TP or a pipeline stage each block of `model.layers`
is compiled on its own, as torchtitan does (torchtitan/distributed/compile.py `apply_compile`):
the blocks share one code object and one shape, so dynamo traces one graph and every block
reuses it (measured: `unique_graphs` 1 for 4 blocks), and FSDP2's all-gathers (dynamo skips FSDP
hooks) and TP's DTensors stay outside or inside it as they are in eager. FSDP keeps block graphs
on torch 2.13 (measured, docs/performance.md): its hooks are dynamo-disabled with no switch (no
"traceable FSDP2"), a whole-model compile with graph breaks falls back to the same block graphs,
and compiled autograd drops FSDP2's end-of-backward callback (the root unit is never
reduce-scattered); compiling the last norm, the loss or the optimizer step gained nothing. As `nn.Module.compile`
does, the compiled callable is only recorded on the module (`_compiled_call_impl`, which
nn.Module's call uses), so the module, its parameter names and its place against fsdp/ddp stay
as they were; it must come after activation checkpointing, which replaces each block with its
wrapper. TP without sequence parallel is refused (`rules.check_compile`); pipeline stages
compile their own blocks.

torch compiles lazily, on a block's first call: that is where a failure shows. With
`compile = true` it is a `CompileError` naming the block and torch's reason; with "auto" the
module falls back to eager with one warning line (rank 0's) naming both. Inductor needs a C++ compiler on
CPU (`$CXX`, else g++): `check_compiler` refuses `true` before any worker starts.

The FX graph and AOTAutograd caches go to `<run dir>/compile-cache`, private to its owner
(meshrun.parallel.compile_cache: `use_run_cache`), so a restarted or resumed run loads its
kernels instead of compiling them again, and skips inductor's CPU ISA probe (`settle_vec_isa`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from meshrun.errors import ModelError
from meshrun.parallel.compile_cache import (
    CACHE_DIR,
    compiler_path,
    settle_vec_isa,
    use_run_cache,
    warn_once,
)

__all__ = ["CACHE_DIR", "CompileClock", "CompileError", "apply_compile", "check_compiler", "compiler_path",
           "layout_allows", "mode", "use_run_cache", "warn_once"]


class CompileError(ModelError):
    """torch.compile failed on a module and train.compile = true asked for no fallback."""


def mode(setting: bool | None) -> str:
    """'off', 'on' or 'auto' for train.compile's false, true and "auto" (None)."""
    return "auto" if setting is None else ("on" if setting else "off")


def check_compiler(setting: bool | None) -> bool:
    """Whether compiling can go ahead; a missing compiler is an error for true, a warning for "auto".

    Runs in `meshrun train`'s pre-flight (before any worker) and again in each worker.
    """
    if mode(setting) == "off":
        return False
    if compiler_path() is not None:
        return True
    name = os.environ.get("CXX") or "g++"
    if mode(setting) == "on":
        raise CompileError(f"train.compile=true needs a C++ compiler for inductor, but {name!r} is not on PATH; "
                           "install g++ (or set CXX), or set train.compile=\"auto\" or false")
    warn_once("train.compile=\"auto\": no C++ compiler (%r) on PATH; training eagerly", name)
    return False


def layout_allows(setting: bool | None, tp: int, sequence_parallel: bool, cp: int = 1, experts: int = 0) -> bool:
    """Whether the layout lets compiling go ahead: rules.check_compile's error for true, a warning for "auto"."""
    from meshrun.errors import ConfigError
    from meshrun.parallel.rules import check_compile

    try:
        check_compile(mode(setting) != "off", tp, sequence_parallel, cp, experts)
    except ConfigError as exc:
        if mode(setting) == "on":
            raise
        warn_once("train.compile=\"auto\": %s; training eagerly", exc)
        return False
    return mode(setting) != "off"


def apply_compile(model: Any, setting: bool | None, *, backend: str = "inductor", scope: str = "auto",
                  options: dict | None = None) -> list[str]:
    """Compile `model` in place (fullgraph), whole or block by block; returns the compiled names.

    scope "auto" compiles the whole model (embedding, blocks, norm and head in one graph) where
    `whole_model_allows` says so, else each block of `model.layers`; "blocks" and "whole" force
    one. A model without `layers` (a user factory's) is compiled whole. Each compiled callable
    is wrapped by `_Guarded`, which turns the first call's failure into a `CompileError` (true)
    or a warning and eager execution of that module ("auto"). `options` go to inductor.
    """
    if not check_compiler(setting):
        return []
    import torch

    settle_vec_isa()  # before the first compile: part of inductor's cache key
    layers = getattr(model, "layers", None)
    whole = layers is None or scope == "whole" or (scope == "auto" and whole_model_allows(model))
    if whole:
        targets = [(type(model).__name__, model)]
    else:
        targets = [(f"layers.{name}", block) for name, block in layers.named_children()]
    for name, module in targets:
        compiled = torch.compile(module._call_impl, backend=backend, fullgraph=True, options=options)
        module._compiled_call_impl = _Guarded(name, module, compiled, fallback=mode(setting) == "auto")
    return [name for name, _ in targets]


def whole_model_allows(model: Any) -> bool:
    """Whether one graph can hold the whole model: the model says it can (`compiles_whole = True`,
    as meshrun's own Transformer does; Hugging Face models keep per-block graphs: their top level
    is not checked to trace whole), its tensors are plain (no FSDP/TP DTensors, whose hooks and
    collectives stay outside compiled blocks) and it is a whole model, not a pipeline stage.

    One graph cuts the per-block calls and lets inductor fuse the embedding, the last norm and
    the head with their neighbours (benchmarks/compile_speedup.py: "whole" against "blocks").
    DDP wraps the compiled model afterwards, so its gradient hooks still run as in eager.
    """
    from torch.distributed.tensor import DTensor

    if getattr(type(model), "compiles_whole", False) is not True or any(isinstance(p, DTensor) for p in model.parameters()):
        return False
    return all(getattr(model, part, None) is not None for part in ("tok_embeddings", "norm", "output"))


class _Guarded:
    """A module's compiled call; its first call compiles, and a failure there is handled once."""

    def __init__(self, name: str, module: Any, compiled: Callable, *, fallback: bool) -> None:
        self.name, self.module, self.compiled, self.fallback = name, module, compiled, fallback
        self.ok = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.ok:
            return self.compiled(*args, **kwargs)
        try:
            out = self.compiled(*args, **kwargs)
        except Exception as exc:  # dynamo, AOTAutograd and inductor raise many types; all mean "did not compile"
            reason = one_line(exc)
            if not self.fallback:
                raise CompileError(f"train.compile: compiling {self.name} failed: {reason}; "
                                   "set train.compile=\"auto\" to fall back to eager, or false") from None
            warn_once("train.compile=\"auto\": compiling %s failed (%s); it runs eagerly", self.name, reason)
            self.module._compiled_call_impl = None  # nn.Module's own call from now on
            return self.module._call_impl(*args, **kwargs)
        self.ok = True
        return out


def one_line(exc: BaseException) -> str:
    """torch's reason, shortened to its first meaningful line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


class CompileClock:
    """The first step's compile: the progress line before it, the metrics row after it.

        clock = CompileClock(cfg.train.compile, compiled=bool(names))
        progress.write(clock.notice())   # "compiling ..." or "" when nothing is compiled
        ... first step ...
        metrics.log_meta(**clock.record(first_step_s))
    """

    def __init__(self, setting: bool | None, *, compiled: bool, cache_dir: str | None = None) -> None:
        self.active = compiled and mode(setting) != "off"
        self.cache_dir = cache_dir or os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")

    def notice(self) -> str:
        if not self.active:
            return ""
        return f"compiling the model (torch.compile, cache {self.cache_dir or 'inductor default'}) in the first step..."

    def record(self, first_step_s: float) -> dict[str, Any]:
        """The compile's figures for metrics.jsonl: seconds and the caches' hits and misses."""
        if not self.active:
            return {}
        from torch._dynamo.utils import compilation_time_metrics, counters

        spent = compilation_time_metrics.get("_compile.compile_inner", [])
        backward = compilation_time_metrics.get("compile_fx.<locals>.bw_compiler", [])
        return dict(event="compile", compile_s=round(sum(spent) + sum(backward), 3),
                    first_step_s=round(first_step_s, 3),
                    fx_graph_cache_hit=counters["inductor"]["fxgraph_cache_hit"],
                    fx_graph_cache_miss=counters["inductor"]["fxgraph_cache_miss"],
                    autograd_cache_hit=counters["aot_autograd"]["autograd_cache_hit"],
                    autograd_cache_miss=counters["aot_autograd"]["autograd_cache_miss"],
                    graph_breaks=sum(counters["graph_break"].values()))
