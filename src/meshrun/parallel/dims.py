"""`ParallelDims`: parallel degrees -> one named DeviceMesh, with the arithmetic checked up front.

    dims = ParallelDims(dp_replicate=1, dp_shard=-1, tp=2, pp=1, world_size=4)  # dp_shard -> 2
    dims.check_model(n_heads=4, n_kv_heads=4, n_layers=2)   # before any process group exists
    mesh = dims.build_mesh("cpu")                           # after init_process_group
    mesh["tp"], dims.dp_mesh(mesh), dims.dp_rank(mesh)

The idea is torchtitan's `ParallelDims` (torchtitan/distributed/parallel_dims.py): one object owns
the degrees, infers the one left as -1, names the mesh axes and builds the flattened axes the
data loader and loss averaging need. Every degree check raises a one-line `ConfigError` that names
the `parallel.*` key and lists values that would work, so a bad layout fails before any process
group is created (and before any rank waits on a peer).

Mesh decision: the mesh always has all four axes ("pp", "dp_replicate", "dp_shard", "tp"), size 1
included, so `mesh["tp"]` and `mesh["dp"]` exist in every layout and callers never branch on
which axes were built; whether a parallelism is on is the `*_enabled` flag, not the axis's
existence. Axis order follows torchtitan: tp innermost (neighbouring ranks, the fastest links),
pp outermost. The flattened axis "dp" (dp_replicate x dp_shard) is the group data is split
over and losses are averaged over; get it with `dims.dp_mesh(mesh)` (torch 2.13 warns that
slicing a flattened axis from the root, `mesh["dp"]`, is deprecated). A "dp_shard_cp" axis would only differ from "dp_shard" with
context parallelism, which meshrun does not have, so it is not built.
See https://docs.pytorch.org/tutorials/recipes/distributed_device_mesh.html
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from math import gcd, prod
from typing import TYPE_CHECKING

from meshrun.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Outermost to innermost. Only these names are ever built.
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "tp")
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _listing(values: list[int]) -> str:
    return ", ".join(str(v) for v in values) if values else "none"


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees for `world_size` ranks; -1 in at most one degree means "the ranks left"."""

    dp_replicate: int
    """Data-parallel replicas (DDP, or the replicate axis of HSDP)."""
    dp_shard: int
    """Data-parallel shards (FSDP2 `fully_shard`); with dp_replicate > 1 too, this is HSDP."""
    tp: int
    """Tensor-parallel degree: heads and FFN width split over this many ranks."""
    pp: int
    """Pipeline-parallel stages."""
    world_size: int
    """Total number of ranks; the product of the four degrees must equal it."""

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError(f"world size must be an integer >= 1, got {self.world_size!r}")
        for name in DEGREES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
                raise ConfigError(f"parallel.{name} must be an integer >= 1 or -1 (the ranks left), "
                                  f"got {value!r}")
        rest = [name for name in DEGREES if getattr(self, name) == -1]
        if len(rest) > 1:
            raise ConfigError(f"only one of parallel.{', parallel.'.join(DEGREES)} may be -1, "
                              f"got -1 for {', '.join(rest)}; set all but one of them")
        if rest:
            self._infer(rest[0])
        product = prod(getattr(self, name) for name in DEGREES)
        if product != self.world_size:
            raise ConfigError(f"{self._product_text()} = {product} does not equal the world size "
                              f"{self.world_size}; {self._product_fix()}")

    def _infer(self, name: str) -> None:
        others = prod(getattr(self, n) for n in DEGREES if n != name)
        if self.world_size % others:
            fixed = [n for n in DEGREES if n != name and getattr(self, n) > 1]
            raise ConfigError(
                f"parallel.{name}=-1 takes the ranks left, but "
                f"{' x '.join(f'parallel.{n}={getattr(self, n)}' for n in fixed) or '1'} = {others} "
                f"does not divide the world size {self.world_size}; use degrees whose product "
                f"divides it (divisors: {_listing(_divisors(self.world_size))})")
        object.__setattr__(self, name, self.world_size // others)

    def _product_text(self) -> str:
        return " x ".join(f"parallel.{n}={getattr(self, n)}" for n in DEGREES)

    def _product_fix(self) -> str:
        """Name single-key changes that would fit, so the message says what to type."""
        fits = []
        for name in DEGREES:
            others = prod(getattr(self, n) for n in DEGREES if n != name)
            if self.world_size % others == 0:
                fits.append(f"parallel.{name}={self.world_size // others}")
        hint = f"e.g. {' or '.join(fits)}, " if fits else ""
        return f"{hint}or set one degree to -1 to take the ranks left"

    @classmethod
    def from_config(cls, parallel_cfg, world_size: int) -> ParallelDims:
        """From a `[parallel]` section (anything with the four degree attributes).

        With `strategy = "fsdp"` and both data-parallel degrees left at their defaults
        (dp_replicate=-1, dp_shard=1, which mean plain replication), the ranks left go to
        dp_shard instead: asking for FSDP should shard, not silently replicate.
        """
        degrees = {name: getattr(parallel_cfg, name) for name in DEGREES}
        if (getattr(parallel_cfg, "strategy", "ddp") == "fsdp"
                and (degrees["dp_replicate"], degrees["dp_shard"]) == (-1, 1)):
            degrees["dp_replicate"], degrees["dp_shard"] = 1, -1
        return cls(**degrees, world_size=world_size)

    # -- checks against the model and the batch (no process group needed) --------------------

    def check_model(self, *, n_heads: int | None = None, n_kv_heads: int | None = None,
                    n_layers: int | None = None) -> None:
        """Raise ConfigError if tp does not divide the heads or pp exceeds the blocks.

        None skips a check (a user model that does not say). Colwise TP gives each rank whole
        heads, so tp must divide both the query and the key/value head counts.
        """
        if self.tp > 1:
            for key, heads in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
                if heads is not None and heads % self.tp:
                    common = gcd(n_heads or heads, n_kv_heads or heads)
                    valid = [d for d in _divisors(common) if self.world_size % d == 0]
                    raise ConfigError(f"parallel.tp={self.tp} does not divide model.{key}={heads}; "
                                      f"valid: {_listing(valid)}")
        if n_layers is not None and self.pp > n_layers:
            valid = [d for d in _divisors(self.world_size) if d <= n_layers]
            raise ConfigError(f"parallel.pp={self.pp} exceeds model.n_layers={n_layers} (a stage "
                              f"needs at least one block); valid: {_listing(valid)}")

    def check_model_args(self, args) -> None:
        """`check_model` from an object with n_heads / n_kv_heads / n_layers attributes."""
        self.check_model(n_heads=getattr(args, "n_heads", None),
                         n_kv_heads=getattr(args, "n_kv_heads", None) or getattr(args, "n_heads", None),
                         n_layers=getattr(args, "n_layers", None))

    def check_batch(self, batch_size: int, microbatches: int = 0) -> int:
        """Check the pipeline micro-batching of a per-rank batch; return the micro-batch count.

        microbatches 0 means one per stage. Without pipeline parallelism this always passes.
        """
        if not self.pp_enabled:
            return 1
        n = microbatches or self.pp
        if n < 1 or batch_size % n:
            valid = _divisors(batch_size)
            raise ConfigError(f"parallel.pp_microbatches={n} does not divide train.batch_size="
                              f"{batch_size}; valid: {_listing(valid)}")
        return n

    # -- flags and sizes ------------------------------------------------------------------------

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        """FSDP2 is on (HSDP when dp_replicate is too)."""
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard_enabled

    @property
    def dp_enabled(self) -> bool:
        return self.dp_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: the data loader's num_replicas."""
        return self.dp_replicate * self.dp_shard

    @property
    def degrees(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in DEGREES}

    def describe(self) -> str:
        """One line for logs, e.g. 'dp_shard 2 x tp 2 (world 4)'."""
        on = [f"{name} {getattr(self, name)}" for name in MESH_AXES if getattr(self, name) > 1]
        return f"{' x '.join(on) or 'single rank'} (world {self.world_size})"

    # -- the mesh -------------------------------------------------------------------------------

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """One DeviceMesh with axes MESH_AXES plus the flattened "dp"; call after the group exists.

        Every rank must call it (it creates the sub-groups collectively).
        """
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(getattr(self, name) for name in MESH_AXES)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
        self.dp_mesh(mesh)  # create the flattened group now, collectively, on every rank
        return mesh

    @staticmethod
    def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
        """The flattened 1-D "dp" mesh (dp_replicate x dp_shard): ranks holding different samples.

        Idempotent: torch caches a flattened mesh by name on the root mesh.
        """
        return mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")

    @classmethod
    def dp_rank(cls, mesh: DeviceMesh) -> int:
        """This rank's index among the data-parallel ranks: the data loader's rank."""
        return cls.dp_mesh(mesh).get_local_rank()

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh fully_shard gets: 2-D (dp_replicate, dp_shard) for HSDP, else 1-D dp_shard."""
        if self.dp_replicate_enabled:
            return mesh["dp_replicate", "dp_shard"]
        return mesh["dp_shard"]
