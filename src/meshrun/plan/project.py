"""Projected step time, tokens/s and MFU of a simulated layout on a named device and network.

    meshrun plan gpu-8b.toml --simulate --nnodes 16 --nproc-per-node 8 --device h100 --inter-node-gbps 400

The inputs are what the simulation found on each representative rank (`meshrun.train.simulate`):
its collectives per step (kind, mesh dimension, bytes), and the model's FLOPs per token. The terms:
- compute: the step's model FLOPs on this rank (FLOPs per token x the global batch's tokens / the
  world; activation checkpointing adds one more forward, 2 of the 6 N) over the device's dense
  peak times `efficiency`, the share of peak that eager training reaches on large decoders (a
  stated assumption, not a measurement: `--compute-efficiency`, by default the device's, see
  DEVICES);
- communication: each collective's bytes on the wire (ring algorithms: an all-gather sends
  n - 1 shards, a reduce-scatter and an all-to-all (n - 1) / n of their input, an all-reduce twice
  that) over the bandwidth of its group: the device's NVLink within a node, `--inter-node-gbps`
  per GPU when the group's ranks span nodes;
- overlap: data-parallel traffic (FSDP's all-gathers and reduce-scatters, DDP's all-reduce)
  overlaps compute (prefetch, buckets) and only what exceeds it shows; TP's and context parallel's
  collectives sit on the critical path (eager TP, no async TP) and add up, and so do a pipeline's
  sends and receives of activations and gradients;
- pipeline bubble: a schedule of pp stages over m micro-batches with v stages per rank idles
  (pp - 1) / (m x v) of its compute (Narayanan et al., arXiv:2104.04473), added to the compute;
  the zero-bubble schedules are counted as interleaved 1F1B (their weight-gradient passes fill
  part of it: an upper bound).
The step is the slowest representative rank's. MFU is the model FLOPs (no recomputation) per
second per GPU over the dense peak, as torchtitan and nanoGPT count it.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from meshrun.errors import ConfigError


@dataclass(frozen=True)
class Device:
    name: str
    bf16_tflops: float  # dense (no sparsity) bf16/fp16 tensor-core peak
    fp32_tflops: float  # dense fp32 without TF32 (meshrun's fp32 is real fp32)
    memory_gib: float
    nvlink_gbps: float  # GB/s per GPU, one direction, to the other GPUs of its node
    efficiency: float  # the default --compute-efficiency: the share of the peak eager training reaches
    source: str


# Peaks, memory and NVLink: NVIDIA's datasheets (SXM parts; NVLink's bidirectional figure halved).
# Efficiency, an assumption stated with every projection: the model FLOPs share of the dense bf16
# peak that eager (uncompiled) bf16 FSDP training of Llama-class models reached as published by
# torchtitan: H100 33-39% MFU (Llama 3.1 8B, benchmarks/llama3_h100_202412_torchtitan.md) -> 0.40 of
# peak before activation recomputation; A100 50-58% (Llama 3 8B and 70B on 64 A100s,
# docs/performance.md) -> 0.60. H200 and B200: the H100's figure, unmeasured.
DEVICES: dict[str, Device] = {
    "a100": Device("A100 SXM4 80GB", 312.0, 19.5, 80.0, 300.0, 0.60, "NVIDIA A100 datasheet"),
    "h100": Device("H100 SXM5 80GB", 989.0, 67.0, 80.0, 450.0, 0.40, "NVIDIA H100 datasheet"),
    "h200": Device("H200 SXM 141GB", 989.0, 67.0, 141.0, 450.0, 0.40, "NVIDIA H200 datasheet"),
    "b200": Device("B200 180GB", 2250.0, 75.0, 180.0, 900.0, 0.40, "NVIDIA HGX B200 datasheet"),
}

OVERLAPPED = ("dp", "dp_shard", "dp_replicate", "dp_shard_cp", "efsdp", "world")
"""Mesh dimensions whose traffic overlaps compute (data parallel)."""


def seconds_text(seconds: float) -> str:
    if seconds >= 1 or seconds == 0:
        return f"{seconds:.3g} s"
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} us"


def device(name: str) -> Device:
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise ConfigError(f"--device {name!r} is not a known device; known: {', '.join(DEVICES)}") from None


def _sizes(dims) -> dict[str, int]:
    from meshrun.parallel.dims import MESH_AXES

    sizes = {axis: getattr(dims, axis) for axis in MESH_AXES}
    sizes["dp"] = dims.dp_replicate * dims.dp_shard
    sizes["dp_shard_cp"] = dims.dp_shard * dims.cp
    sizes["world"] = dims.world_size
    sizes["ep"], sizes["efsdp"] = dims.ep, dims.efsdp  # dp_shard unflattened into (efsdp, ep) for the experts
    return sizes


_FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp")}


def group_span(dim: str, dims) -> int:
    """How many consecutive ranks a group over `dim` covers (ranks are laid out in MESH_AXES
    order, tp fastest): more than a node's ranks means it crosses nodes."""
    from meshrun.parallel.dims import MESH_AXES

    if dim == "world":
        return dims.world_size
    if dim in ("ep", "efsdp"):  # ep: neighbouring dp_shard ranks; efsdp: every ep-th of them
        stride = prod(getattr(dims, a) for a in MESH_AXES[MESH_AXES.index("dp_shard") + 1:])
        return stride * (dims.ep - 1) + 1 if dim == "ep" else stride * dims.ep * (dims.efsdp - 1) + 1
    parts = _FLATTENED.get(dim, (dim,))
    if any(p not in MESH_AXES for p in parts):
        return dims.world_size  # an ad-hoc group ("ranks 0,1"): assume the worst
    inner = MESH_AXES[MESH_AXES.index(parts[-1]) + 1:]
    stride = prod(getattr(dims, a) for a in inner)
    return stride * (prod(getattr(dims, p) for p in parts) - 1) + 1


def wire_bytes(kind: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends for a collective of `nbytes` input over `n` ranks (ring algorithms)."""
    if n <= 1:
        return 0.0
    if kind == "all_gather":
        return nbytes * (n - 1)
    if kind in ("reduce_scatter", "all_to_all"):
        return nbytes * (n - 1) / n
    if kind == "all_reduce":
        return 2 * nbytes * (n - 1) / n
    return float(nbytes)  # broadcast, send, recv


def pipeline_bubble(layout) -> float:  # noqa: ANN001 - a ResolvedLayout
    """The idle share of a pipeline's compute, (pp - 1) / (micro-batches x stages per rank); 0 without one."""
    plan = layout.pipeline
    if plan is None or layout.dims.pp <= 1:
        return 0.0
    return (layout.dims.pp - 1) / (plan.microbatches * plan.stages_per_rank)


def check_inputs(efficiency: float | None, inter_node_gbps: float) -> None:
    """One line for a projection input out of range (before a simulation, and in `project`)."""
    if efficiency is not None and not 0 < efficiency <= 1:
        raise ConfigError(f"--compute-efficiency must be in (0, 1], got {efficiency:g}")
    if inter_node_gbps <= 0:
        raise ConfigError(f"--inter-node-gbps must be > 0, got {inter_node_gbps:g}")


@dataclass(frozen=True)
class Projection:
    device: Device
    efficiency: float
    inter_node_gbps: float
    compute_s: float
    comm_s: dict[str, float]  # per mesh dimension, on the slowest rank
    exposed_s: float  # communication not hidden behind compute
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float

    def describe(self) -> str:
        comm = ", ".join(f"{d} {seconds_text(s)}" for d, s in sorted(self.comm_s.items())) or "none"
        return (f"projected on {self.device.name} (compute at {self.efficiency:.0%} of {self.device_peak:.0f} TFLOPS, "
                f"NVLink {self.device.nvlink_gbps:.0f} GB/s, inter-node {self.inter_node_gbps:g} Gb/s per GPU): "
                f"step {seconds_text(self.step_s)} = compute {seconds_text(self.compute_s)}"
                f"{f' (with the pipeline bubble, +{self.bubble:.0%})' if self.bubble else ''} + exposed communication "
                f"{seconds_text(self.exposed_s)} (communication per step: {comm}); "
                f"{self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {self.mfu:.1%}")

    device_peak: float = 0.0
    bubble: float = 0.0  # the pipeline's idle share added to the compute (`pipeline_bubble`)


def project(sim, *, flops_per_token: int, seq_len: int, nproc_per_node: int, device_name: str = "h100",
            inter_node_gbps: float = 400.0, efficiency: float | None = None, dtype: str = "bf16",
            activation_checkpointing: bool = False) -> Projection:
    """The projected step of `sim` (a `meshrun.train.simulate.Simulation`)."""
    dev = device(device_name)
    efficiency = dev.efficiency if efficiency is None else efficiency
    check_inputs(efficiency, inter_node_gbps)
    layout = sim.layout
    dims = layout.dims
    options = layout.options
    dp = dims.dp_replicate * dims.dp_shard
    global_tokens = options.batch_size * seq_len * options.grad_accum * dp
    peak = (dev.fp32_tflops if dtype == "fp32" else dev.bf16_tflops) * 1e12
    model_flops = flops_per_token * global_tokens / dims.world_size
    recompute = 4 / 3 if activation_checkpointing else 1.0  # one more forward: 2 N of the 6 N
    compute_s = model_flops * recompute / (peak * efficiency) * (1 + pipeline_bubble(layout))
    sizes = _sizes(dims)
    slowest: tuple[float, float, dict[str, float]] | None = None
    for rank in sim.ranks:
        per_dim: dict[str, float] = {}
        for use in rank.collectives:
            n = sizes.get(use.dim) or (len(use.dim.split(",")) if use.dim.startswith("ranks ") else dims.world_size)
            inter = group_span(use.dim, dims) > nproc_per_node
            bandwidth = (inter_node_gbps / 8 if inter else dev.nvlink_gbps) * 1e9
            per_dim[use.dim] = per_dim.get(use.dim, 0.0) + wire_bytes(use.kind, use.bytes, n) / bandwidth
        hidden = sum(s for d, s in per_dim.items() if d in OVERLAPPED)
        exposed = max(0.0, hidden - compute_s) + sum(s for d, s in per_dim.items() if d not in OVERLAPPED)
        if slowest is None or exposed > slowest[0]:
            slowest = (exposed, compute_s + exposed, per_dim)
    exposed, step_s, per_dim = slowest or (0.0, compute_s, {})
    tokens = global_tokens / step_s / dims.world_size
    return Projection(dev, efficiency, inter_node_gbps, compute_s, per_dim, exposed, step_s, tokens,
                      flops_per_token * tokens / peak, peak / 1e12, pipeline_bubble(layout))
