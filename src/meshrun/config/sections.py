"""The typed sections of a `meshrun train` config; each one validates its own values.

A component takes only its own section: `build_model(cfg.model, vocab_size)`.
Zero in a size field means "the named size's value"; each doc says what its 0 or "" means.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field, fields

from meshrun.config.base import Section, doc_field, fmt
from meshrun.config.fault_section import FaultSection
from meshrun.config.lora_section import LoraSection
from meshrun.config.trackers import check_tracker_names, tracker_names
from meshrun.errors import ConfigError
from meshrun.parallel.resolve import DTYPE_NAMES, ParallelOptions, check_options, stated_degrees
from meshrun.parallel.rules import (
    check_context_parallel,
    check_cp_model,
    check_ep_model,
    check_lora,
    check_optimizer_shards,
    check_packing,
    shards_parameters,
)

# [model] keys that describe the built-in decoder: a model.hf directory's config.json says all of these.
# The longest sequence either key takes: 16M tokens. Its RoPE table alone is 8 GiB at head_dim 128;
# sizes near 2**63 overflowed torch's storage size in the meta build (a traceback, not a line).
MAX_SEQ_LEN = 1 << 24
HF_SHAPE_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len",
                 "tie_embeddings", "rope_theta", "norm_eps", "experts", "experts_per_token", "shared_experts",
                 "moe_every", "moe_hidden", "moe_balance", "moe_aux_coef", "moe_bias_rate")
MOE_COUNT_KEYS = ("experts", "experts_per_token", "shared_experts", "moe_every", "moe_hidden")

SCHEDULES = ("cosine", "constant", "linear", "wsd")  # optim.schedule (meshrun.train.schedules)
OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "muon")  # optim.name (meshrun.train.optimizers)
IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")  # optim.implementation
FUSED = ("adamw", "adam", "sgd")  # the torch.optim classes with a fused kernel
FOREACH = ("adamw", "adam", "sgd", "adafactor")  # ... and with a multi-tensor (foreach) one
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_NNODES = re.compile(r"^(\d+)(?::(\d+))?$")


@dataclass(frozen=True)
class ModelSection(Section):
    """The network: a named size, optionally overridden field by field."""

    section = "model"
    name: str = doc_field("tiny", "Named size: 'tiny', 'tiny-moe' (tiny with 4 experts, top 2, 1 shared), 'small', 'base', '1b', '8b' or '70b' (for planning); the size fields below override it.")
    factory: str = doc_field("", "'' = the built-in Llama-style decoder; 'pkg.module:fn' = your fn(model_cfg, vocab_size) or fn() returns the nn.Module.")
    vocab_size: int = doc_field(0, "Vocabulary size, at least the tokenizer's; 0 = the tokenizer's (byte: 256 + special tokens).")
    dim: int = doc_field(0, "Width of the residual stream (embedding size); 0 = the named size's.")
    n_layers: int = doc_field(0, "Transformer blocks; 0 = the named size's.")
    n_heads: int = doc_field(0, "Attention (query) heads, a divisor of dim; 0 = the named size's.")
    n_kv_heads: int = doc_field(0, "Key/value heads for grouped-query attention; 0 = the named size's (n_heads unless it says less).")
    ffn_hidden: int = doc_field(0, "SwiGLU hidden width; 0 = auto (the named size's, about 8/3 x dim).")
    max_seq_len: int = doc_field(0, "Longest sequence the RoPE tables cover, >= data.seq_len, at most 2**24; 0 = the named size's.")
    tie_embeddings: bool | None = doc_field(None, "Share one matrix between the token embedding and the output projection; 'auto' = the named size's.")
    rope_theta: float = doc_field(0.0, "RoPE base frequency; 0 = the named size's (10000 unless it says otherwise).")
    norm_eps: float = doc_field(0.0, "RMSNorm epsilon; 0 = the named size's (1e-5 unless it says otherwise).")
    experts: int = doc_field(0, "Routed experts of a mixture-of-experts feed-forward; 0 = the named size's (dense unless it says otherwise). See [models.md](models.md#mixture-of-experts).")
    experts_per_token: int = doc_field(0, "Routed experts per token (top-k), 1..experts; 0 = the named size's (2 unless it says otherwise).")
    shared_experts: int = doc_field(0, "Experts every token also goes through (DeepSeekMoE); 0 = the named size's (none unless it says otherwise).")
    moe_every: int = doc_field(0, "An MoE feed-forward in every N-th block, blocks N-1, 2N-1, ... (1 = every block); 0 = the named size's (1 unless it says otherwise).")
    moe_hidden: int = doc_field(0, "Width of one expert; 0 = the named size's, else auto: ffn_hidden / (experts_per_token + shared_experts) rounded up to a multiple of 8.")
    moe_balance: str = doc_field("", "Expert load balancing: 'bias' (DeepSeek-V3's aux-loss-free bias, summed loads of every rank, sigmoid scores), 'aux_loss' (sequence-wise balance loss, softmax scores) or 'none'; '' = the named size's ('bias' unless it says otherwise).")
    moe_aux_coef: float = doc_field(0.0, "Weight of the balance loss under moe_balance='aux_loss' (added per micro-batch); 0 = the named size's (0.01 unless it says otherwise).")
    moe_bias_rate: float = doc_field(0.0, "Bias step per optimizer step under moe_balance='bias' (DeepSeek-V3's gamma); 0 = the named size's (0.001 unless it says otherwise).")
    init_from: str = doc_field("", "Weights file to start from; '' = random initialisation seeded by train.seed.")
    hf: str = doc_field("", "'' = not used; a local Hugging Face model directory (config.json + *.safetensors) of any decoder-only causal LM transformers ships: its architecture and weights, model.name ignored.")

    def validate(self) -> None:
        self.require("name", bool(self.name.strip()), "a size name such as 'tiny'")
        self.require("factory", not self.factory or bool(_FACTORY.match(self.factory)), "'' or 'pkg.module:function'")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            self.at_least(name, 0, " (0 = the named size's)")
        self.require("max_seq_len", self.max_seq_len <= MAX_SEQ_LEN, f"<= {MAX_SEQ_LEN} (2**24 tokens)")
        self.require("rope_theta", self.rope_theta >= 0, ">= 0 (0 = the named size's)")
        self.require("norm_eps", self.norm_eps >= 0, ">= 0 (0 = the named size's)")
        for name in MOE_COUNT_KEYS:
            self.at_least(name, 0, " (0 = the named size's)")
        self.require("moe_balance", self.moe_balance in ("", "bias", "aux_loss", "none"),
                     "'bias', 'aux_loss', 'none' or '' (the named size's)")
        for name in ("moe_aux_coef", "moe_bias_rate"):
            self.require(name, getattr(self, name) >= 0, ">= 0 (0 = the named size's)")
        if self.dim and self.n_heads and self.dim % self.n_heads:
            raise ConfigError(f"model.dim ({self.dim}) must be a multiple of model.n_heads ({self.n_heads})")
        if self.n_heads and self.n_kv_heads and self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.n_kv_heads})"
            )
        self._check_hf()

    def _check_hf(self) -> None:
        """model.hf against the other [model] keys: the directory gives the architecture and the
        weights, so factory, init_from and the size keys would contradict it. Its files are read
        before launch (train/preflight.py), not here."""
        if not self.hf:
            return
        if self.factory:
            raise ConfigError(f"model.hf={self.hf!r} and model.factory={self.factory!r} both build the model; "
                              "set one of them")
        if self.init_from:
            raise ConfigError(f"model.hf={self.hf!r} loads its own weights, so model.init_from="
                              f"{self.init_from!r} would overwrite them; drop model.init_from")
        for key in HF_SHAPE_KEYS:
            value = getattr(self, key)
            if value not in (0, None, "") and value is not False:
                raise ConfigError(f"model.{key}={value!r} cannot change the shape of model.hf={self.hf!r} "
                                  f"(its config.json says it); drop model.{key}")


@dataclass(frozen=True)
class DataSection(Section):
    """What is read, how it is tokenized, and how much is held out for eval."""

    section = "data"
    path: str = doc_field("", "'' = the corpus built into meshrun; else a token directory from `meshrun data prepare`, or a .txt file.")
    tokenizer: str = doc_field("byte", "'byte' = one token per UTF-8 byte (vocab 256); else a local Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json: its eos ends each document) or a tokenizer.json.")
    seq_len: int = doc_field(128, "Tokens per training sample (the context length), at most 2**24.")
    val_fraction: float = doc_field(0.05, "Share of the data held out for eval loss, 0 < x < 0.5.")
    shuffle: bool = doc_field(True, "Reshuffle the sample order every epoch (seeded by train.seed).")
    num_workers: int = doc_field(0, "DataLoader worker processes per rank; 0 = load in the training process.")
    packing: bool = doc_field(False, "Pack whole examples of a chat / prompt-completion token directory into each sequence, attention kept inside each example, positions restarting per example; false = windows of seq_len over the examples back to back.")

    def validate(self) -> None:
        self.require("tokenizer", bool(self.tokenizer.strip()), "'byte', a tokenizer directory or a tokenizer.json file")
        self.at_least("seq_len", 1)
        self.require("seq_len", self.seq_len <= MAX_SEQ_LEN, f"<= {MAX_SEQ_LEN} (2**24 tokens)")
        self.require("val_fraction", 0 < self.val_fraction < 0.5, "> 0 and < 0.5")
        self.at_least("num_workers", 0)


@dataclass(frozen=True)
class TrainSection(Section):
    """The step loop: length, batch, precision, eval and logging cadence, where runs go."""

    section = "train"
    steps: int = doc_field(300, "Optimizer steps to run.")
    batch_size: int = doc_field(16, "Samples per micro-batch on each data-parallel rank; global batch = this x grad_accum x ranks.")
    grad_accum: int = doc_field(1, "Micro-batches per optimizer step; DDP all-reduces gradients on the last one only (FSDP: sync_each_micro_batch).")
    sync_each_micro_batch: bool = doc_field(True, "Under FSDP/HSDP with grad_accum > 1: reduce-scatter every micro-batch's gradients, which stay sharded (least memory; HSDP all-reduces across replicas on the last only); false = only on the last (fewer collectives, but every rank holds the whole model's unsharded fp32 gradients until then).")
    dtype: str = doc_field("fp32", "'fp32', 'bf16' (bf16 autocast; FSDP computes in bf16), or 'fp16' (the same with a gradient scaler); weights and optimizer state stay fp32.")
    loss_scale: float = doc_field(65536.0, "fp16 only: the gradient scaler's initial loss scale (halved on each overflow, which skips that step; doubled after 2000 clean steps).")
    seed: int = doc_field(1337, "Seed for the initial weights and the data order; the same seed gives the same run.")
    eval_interval: int = doc_field(100, "Steps between eval passes; 0 = only at the end.")
    eval_steps: int = doc_field(20, "Batches per eval pass, on each rank.")
    log_interval: int = doc_field(10, "Steps between progress updates on rank 0.")
    grad_clip: float = doc_field(1.0, "Clip the global gradient norm to this; 0 = no clipping.")
    activation_checkpointing: bool = doc_field(False, "Recompute each block's activations in backward: less memory, ~1/3 more compute.")
    compile: bool | None = doc_field(False, "torch.compile the model (inductor; whole in one graph for one process and DDP, each transformer block under FSDP/TP/PP; the first step compiles, cached in <run dir>/compile-cache); 'auto' = the same, but eager with a warning if compiling fails.")
    run_dir: str = doc_field("runs", "Directory that holds one directory per run.")
    name: str = doc_field("", "Run name, its directory under run_dir; '' = the start time, e.g. 20250131-154210.")

    def validate(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "eval_steps", "log_interval"):
            self.at_least(name, 1)
        self.one_of("dtype", DTYPE_NAMES)
        self.require("loss_scale", self.loss_scale > 0, "> 0")
        self.at_least("seed", 0)
        self.at_least("eval_interval", 0, " (0 = only at the end)")
        self.at_least("grad_clip", 0, " (0 = off)")
        self.require("run_dir", bool(self.run_dir), "a directory path")
        self.require("name", "/" not in self.name and self.name not in (".", ".."), "a plain name (put directories in train.run_dir)")


@dataclass(frozen=True)
class OptimSection(Section):
    """The optimizer (torch.optim) and its learning-rate schedule (linear warmup, then decay to min_lr)."""

    section = "optim"
    name: str = doc_field("adamw", "'adamw', 'adam' (weight decay as L2), 'sgd', 'adafactor', or 'muon' (hidden matrices; AdamW for embeddings, head, gains, biases).")
    lr: float = doc_field(1e-3, "Peak learning rate, reached at the end of warmup (Muon's is scaled to match AdamW's update size).")
    min_lr: float = doc_field(1e-4, "Learning rate the decay ends at (cosine, linear, wsd); <= lr.")
    weight_decay: float = doc_field(0.1, "Weight decay, on matrices and embeddings only (2+ dims), never on norm gains or biases.")
    beta1: float = doc_field(0.9, "Adam/AdamW first-moment decay, in [0, 1).")
    beta2: float = doc_field(0.95, "Adam/AdamW second-moment decay, in [0, 1).")
    eps: float = doc_field(1e-8, "Adam/AdamW denominator epsilon, > 0.")
    momentum: float = doc_field(0.9, "SGD momentum, in [0, 1); 0 = plain SGD.")
    nesterov: bool = doc_field(False, "SGD with Nesterov momentum (needs momentum > 0).")
    implementation: str = doc_field("auto", "'auto' = the fused kernel where the optimizer has one for the device, else torch's default (foreach on GPUs, for-loop on CPU); or 'fused', 'foreach', 'for-loop'.")
    warmup_steps: int = doc_field(30, "Steps of linear warmup from 0 to lr; 0 = start at lr.")
    schedule: str = doc_field("cosine", "After warmup: 'cosine' or 'linear' decay to min_lr, 'constant' at lr, or 'wsd' (stable at lr, then linear decay over decay_fraction).")
    decay_fraction: float = doc_field(0.2, "With schedule 'wsd': share of the steps after warmup spent decaying, in (0, 1].")

    def validate(self) -> None:
        self.one_of("name", OPTIMIZERS)
        self.require("lr", self.lr > 0, "> 0")
        self.at_least("min_lr", 0)
        self.require("min_lr", self.min_lr <= self.lr, f"<= optim.lr ({self.lr})")
        self.at_least("weight_decay", 0)
        for name in ("beta1", "beta2", "momentum"):
            self.require(name, 0 <= getattr(self, name) < 1, "in [0, 1)")
        self.require("eps", self.eps > 0, "> 0")
        self.require("nesterov", not self.nesterov or self.momentum > 0, "false when optim.momentum = 0 (or set momentum > 0)")
        self.one_of("implementation", IMPLEMENTATIONS)
        for kind, names in (("fused", FUSED), ("foreach", FOREACH)):
            ok = self.implementation != kind or self.name in names or self.name == "muon"  # its AdamW
            self.require("implementation", ok, f"'auto' or 'for-loop' with optim.name = {self.name!r} "
                          f"(a {kind} kernel exists for {', '.join(names)})")
        self.at_least("warmup_steps", 0)
        self.one_of("schedule", SCHEDULES)
        self.require("decay_fraction", 0 < self.decay_fraction <= 1, "in (0, 1]")


@dataclass(frozen=True)
class ParallelSection(Section):
    """How the model and batch spread over ranks; degrees are checked against the world size at start.

    Every rule is `meshrun.parallel.resolve`'s: `validate` runs the ones that need no world size.
    """

    section = "parallel"
    strategy: str = doc_field("ddp", "'ddp' = every rank holds the whole model (or its pipeline stages) and gradients are all-reduced; 'fsdp' = FSDP2/HSDP, tensor and pipeline parallel over one DeviceMesh, from the degrees below.")
    dp_replicate: int = doc_field(-1, "Data-parallel replicas; -1 = the ranks left after the other degrees.")
    dp_shard: int = doc_field(1, "Data-parallel shards (FSDP); 1 = no sharding, -1 = the ranks left.")
    cp: int = doc_field(1, "Context-parallel degree: each sequence split over this many ranks (ring attention, head-tail load balanced; data.seq_len divisible by 2 x cp; needs strategy 'fsdp', the built-in model or model.hf with full causal attention); 1 = off.")
    tp: int = doc_field(1, "Tensor-parallel degree (heads and FFN split over ranks); 1 = off.")
    pp: int = doc_field(1, "Pipeline-parallel stages; 1 = off.")
    ep: int = doc_field(1, "Expert-parallel degree: the routed experts (model.experts, divisible by ep) split over this many of the dp_shard ranks, tokens sent to them by all-to-all; borrows from dp_shard (ep divides it; strategy 'fsdp', cp = 1; tp splits the dense parts beside it); 1 = off.")
    pp_schedule: str = doc_field("gpipe", "Pipeline schedule: 'gpipe', '1f1b' (one stage per rank), or 'interleaved_1f1b', 'looped_bfs', 'interleaved_zero_bubble' (several per rank; zero bubble only without data parallel).")
    pp_microbatches: int = doc_field(0, "Micro-batches per pipeline step, dividing train.batch_size; 0 = one per stage.")
    pp_stages_per_rank: int = doc_field(0, "Pipeline stages each rank holds; 0 = 1, or 2 for the interleaved schedules (which need >= 2).")
    pp_split_points: str = doc_field("", "'' = blocks balanced over the stages; else the first block of each stage after the first, e.g. '1,3' or 'layers.1,layers.3'.")
    sequence_parallel: bool = doc_field(False, "TP: also split the norms' activations along the sequence (needs tp > 1, pp = 1).")
    loss_parallel: bool = doc_field(False, "TP: compute the loss on vocabulary-sharded logits, never gathering them (needs tp > 1, pp = 1).")
    fsdp_reshard_after_forward: bool = doc_field(True, "FSDP: free gathered parameters after forward and gather again in backward.")
    fsdp_cpu_offload: bool = doc_field(False, "FSDP: keep sharded parameters, gradients and optimizer state in host memory (for accelerators; no effect on CPU).")
    param_dtype: str = doc_field("auto", "FSDP compute dtype of parameters: 'auto' = train.dtype, or 'fp32', 'bf16', 'fp16' (fp16 needs train.dtype 'fp16').")
    reduce_dtype: str = doc_field("fp32", "FSDP dtype of the gradient reduce-scatter: 'fp32' or 'bf16'.")

    def validate(self) -> None:
        check_options(ParallelOptions.from_sections(self))


@dataclass(frozen=True)
class CheckpointSection(Section):
    """Saving during training and resuming; the final weights are saved either way."""

    section = "checkpoint"
    interval: int = doc_field(100, "Steps between checkpoints (also one at the last step, and on SIGTERM/SIGINT); 0 = none during training (SIGTERM/SIGINT still save).")
    keep: int = doc_field(3, "Checkpoints kept on disk; older ones are deleted.")
    async_save: bool = doc_field(False, "Write checkpoints in the background while training goes on.")
    resume: str = doc_field("auto", "'auto' = from the run's latest valid checkpoint if any, 'never', or a checkpoint path.")
    sample_log: bool = doc_field(False, "Append each step's data indices per rank to <run dir>/samples/ (audits exactly-once resume).")
    snapshot_interval: str = doc_field("auto", "Steps between in-memory snapshots in /dev/shm, which a restart on the same host resumes from when newer than the disk checkpoint; 'auto' = as often as costs <= 2% of step time; 0 = off.", int_ok=True)

    def validate(self) -> None:
        self.at_least("interval", 0, " (0 = off)")
        self.at_least("keep", 1)
        n = self.snapshot_interval
        if not (n == "auto" or n.isdigit()):
            raise ConfigError(f"checkpoint.snapshot_interval must be 'auto' or a number >= 0 (0 = off), got {n!r}")
        self.require("resume", bool(self.resume), "'auto', 'never' or a checkpoint path")


@dataclass(frozen=True)
class MetricsSection(Section):
    """What is recorded in the run directory, and how often."""

    section = "metrics"
    interval: int = doc_field(10, "Steps between metric rows (loss, lr, grad norm, tokens/s, step time, memory).")
    tensorboard: bool = doc_field(True, "Also write TensorBoard events, when tensorboard is installed (best effort; 'tensorboard' in trackers makes it required).")
    jsonl: bool = doc_field(True, "Write <run dir>/metrics.jsonl, one JSON object per row.")
    trackers: str = doc_field("", "Experiment trackers, rank 0, local files by default: any of 'tensorboard', 'mlflow', 'wandb', 'trackio', e.g. [\"mlflow\", \"wandb\"]; [] = none besides tensorboard above.", list_ok=True)
    charts: str = doc_field("auto", "Charts of the report written at the end of a run: 'png' (matplotlib), 'svg' (drawn inline, no matplotlib: about a second less) or 'auto' (png when matplotlib is installed).")

    def validate(self) -> None:
        self.at_least("interval", 1)
        check_tracker_names(self.trackers)
        self.one_of("charts", ("auto", "png", "svg"))
        self.require("charts", self.charts != "png" or importlib.util.find_spec("matplotlib") is not None,
                     "'auto' or 'svg' without matplotlib (pip install 'meshrun[report]' for PNG charts)")

    @property
    def tracker_names(self) -> tuple[str, ...]:
        """`trackers` as names: "mlflow,wandb" -> ("mlflow", "wandb")."""
        return tracker_names(self.trackers)


@dataclass(frozen=True)
class LaunchSection(Section):
    """How workers start: the torchrun options that `meshrun train` passes to the launcher."""

    section = "launch"
    nproc_per_node: str = doc_field("auto", "Worker processes per node: 'auto' = one per GPU, else 2-4 on CPU; or a number.", int_ok=True)
    max_restarts: int = doc_field(0, "Times all workers restart after a failure before the job fails.")
    nnodes: str = doc_field("1", "Nodes: N, or MIN:MAX for an elastic job.", int_ok=True)
    rdzv_endpoint: str = doc_field("", "HOST:PORT of the rendezvous for several nodes; '' = a free local port on one node.")
    rdzv_id: str = doc_field("none", "Job id that every node of one job shares.", int_ok=True)
    rdzv_backend: str = doc_field("static", "Rendezvous backend as in torchrun: 'static' or 'c10d' (one node picks c10d itself).")

    def validate(self) -> None:
        n = self.nproc_per_node
        if not (n == "auto" or (n.isdigit() and int(n) >= 1)):
            shown = n if n.lstrip("-").isdigit() else fmt(n)
            raise ConfigError(f"launch.nproc_per_node must be 'auto' or >= 1, got {shown}")
        self.at_least("max_restarts", 0)
        m = _NNODES.match(self.nnodes)
        ok = bool(m) and 1 <= int(m[1]) <= int(m[2] or m[1])
        self.require("nnodes", ok, "N or MIN:MAX with 1 <= MIN <= MAX (e.g. 2 or 1:4)")
        self.require("rdzv_backend", bool(self.rdzv_backend), "a rendezvous backend such as 'static' or 'c10d'")


@dataclass(frozen=True)
class JobConfig:
    """One `meshrun train` job: every section, each validated, plus checks that span two."""

    model: ModelSection = field(default_factory=ModelSection, metadata={"doc": ModelSection.__doc__})
    data: DataSection = field(default_factory=DataSection, metadata={"doc": DataSection.__doc__})
    train: TrainSection = field(default_factory=TrainSection, metadata={"doc": TrainSection.__doc__})
    optim: OptimSection = field(default_factory=OptimSection, metadata={"doc": OptimSection.__doc__})
    parallel: ParallelSection = field(default_factory=ParallelSection, metadata={"doc": ParallelSection.__doc__})
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection, metadata={"doc": CheckpointSection.__doc__})
    metrics: MetricsSection = field(default_factory=MetricsSection, metadata={"doc": MetricsSection.__doc__})
    launch: LaunchSection = field(default_factory=LaunchSection, metadata={"doc": LaunchSection.__doc__})
    fault: FaultSection = field(default_factory=FaultSection, metadata={"doc": FaultSection.__doc__})
    lora: LoraSection = field(default_factory=LoraSection, metadata={"doc": LoraSection.__doc__})

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name} must be a {cls.__name__}, got {fmt(getattr(self, name))}")
        model, data = self.model, self.data
        if shards_parameters(self.parallel.strategy, ParallelOptions.from_sections(self.parallel).degrees):
            check_optimizer_shards(self.optim.name, self.optim.implementation)
        degrees = stated_degrees(ParallelOptions.from_sections(self.parallel))
        check_context_parallel(degrees["cp"], seq_len=data.seq_len)
        check_cp_model(degrees["cp"], factory=model.factory)
        check_ep_model(self.parallel.ep, hf=model.hf, factory=model.factory)
        check_packing(data.packing, cp=degrees["cp"], factory=model.factory)
        check_lora(self.lora.rank, degrees["tp"], degrees["pp"])
        if model.max_seq_len and data.seq_len > model.max_seq_len:
            raise ConfigError(
                f"data.seq_len ({data.seq_len}) must be <= model.max_seq_len ({model.max_seq_len}); "
                "raise model.max_seq_len or set it to 0 (the named size's)"
            )


SECTIONS: dict[str, type[Section]] = {
    "model": ModelSection,
    "data": DataSection,
    "train": TrainSection,
    "optim": OptimSection,
    "parallel": ParallelSection,
    "checkpoint": CheckpointSection,
    "metrics": MetricsSection,
    "launch": LaunchSection,
    "fault": FaultSection,
    "lora": LoraSection,
}
assert list(SECTIONS) == [f.name for f in fields(JobConfig)], "SECTIONS must list JobConfig's fields in order"
