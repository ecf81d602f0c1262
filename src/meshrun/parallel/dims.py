"""`ParallelDims`: parallel degrees -> one named DeviceMesh, with the arithmetic checked up front.

    dims = ParallelDims(dp_replicate=1, dp_shard=-1, tp=2, pp=1, world_size=4)  # dp_shard -> 2
    dims.check_model(n_heads=4, n_kv_heads=4, n_layers=2)   # before any process group exists
    mesh = dims.build_mesh("cpu")                           # after init_process_group
    mesh["tp"], dims.dp_mesh(mesh), dims.dp_rank(mesh)

The idea is torchtitan's `ParallelDims` (torchtitan/distributed/parallel_dims.py): one object owns
the degrees, infers the one left as -1, names the mesh axes and builds the flattened axes the
data loader and loss averaging need. The degree checks are `meshrun.parallel.rules`' (one-line
`ConfigError`s naming the `parallel.*` key and values that would work), so a bad layout fails
before any process group is created (and before any rank waits on a peer).

Mesh decision: the mesh always has all five axes ("pp", "dp_replicate", "dp_shard", "cp", "tp"), size 1
included, so `mesh["tp"]` and `mesh["dp"]` exist in every layout and callers never branch on
which axes were built; whether a parallelism is on is the `*_enabled` flag, not the axis's
existence. Axis order follows torchtitan: tp innermost (neighbouring ranks, the fastest links),
pp outermost, cp just outside tp. The flattened axis "dp" (dp_replicate x dp_shard) is the group
data is split over; get it with `dims.dp_mesh(mesh)` (torch 2.13 warns that slicing a flattened
axis from the root, `mesh["dp"]`, is deprecated). The cp ranks of one dp rank read the same batch
and split its sequence (meshrun.parallel.context); they shard the parameters together with the
dp_shard ranks, as torchtitan does: FSDP runs over the flattened "dp_shard_cp" axis
(`dims.fsdp_mesh(mesh)`), built only when cp > 1, so gradients are averaged over every token.
See https://docs.pytorch.org/tutorials/recipes/distributed_device_mesh.html
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from meshrun.parallel import rules
from meshrun.parallel.rules import DEGREES

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Outermost to innermost. Only these names are ever built.
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
__all__ = ["DEGREES", "MESH_AXES", "ParallelDims"]


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees for `world_size` ranks; -1 in at most one degree means "the ranks left".

    The checks and the inference are `meshrun.parallel.rules.resolve_degrees`; a whole layout
    (strategy, model shape, pipeline) is resolved by `meshrun.parallel.resolve.resolve_layout`.
    """

    dp_replicate: int
    """Data-parallel replicas (DDP, or the replicate axis of HSDP)."""
    dp_shard: int
    """Data-parallel shards (FSDP2 `fully_shard`); with dp_replicate > 1 too, this is HSDP."""
    tp: int
    """Tensor-parallel degree: heads and FFN width split over this many ranks."""
    pp: int
    """Pipeline-parallel stages."""
    world_size: int
    """Total number of ranks; the product of the five degrees must equal it."""
    cp: int = 1
    """Context-parallel degree: each sequence split over this many ranks (ring attention)."""
    ep: int = 1
    """Expert-parallel degree: routed experts split over this many of the dp_shard ranks (not a
    factor of the world size: it borrows from dp_shard, as torchtitan's ep does)."""
    _expert_meshes: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        resolved = rules.resolve_degrees({name: getattr(self, name) for name in DEGREES}, self.world_size)
        for name, value in resolved.items():
            object.__setattr__(self, name, value)  # frozen: the one -1 becomes the ranks left
        rules.check_expert_parallel(self.ep, dp_shard=self.dp_shard, cp=self.cp)

    @classmethod
    def from_config(cls, parallel_cfg, world_size: int) -> ParallelDims:
        """From a `[parallel]` section (anything with the degree attributes and a strategy),
        with the strategy's default applied (`rules.strategy_degrees`: fsdp shards the ranks
        left). Prefer `resolve_layout`, which checks the whole layout."""
        degrees = {name: getattr(parallel_cfg, name, 1) for name in DEGREES}
        return cls(**rules.strategy_degrees(getattr(parallel_cfg, "strategy", "ddp"), degrees),
                   world_size=world_size, ep=getattr(parallel_cfg, "ep", 1))

    # -- checks against the model (no process group needed) ------------------------------------

    def check_model(self, *, n_heads: int | None = None, n_kv_heads: int | None = None,
                    n_layers: int | None = None, tie_embeddings: bool | None = None,
                    experts: int | None = None) -> None:
        """Raise ConfigError if tp does not divide the heads or pp exceeds the blocks
        (`rules.check_model_shape`); None skips a check (a user model that does not say)."""
        rules.check_model_shape(tp=self.tp, pp=self.pp, world_size=self.world_size, n_heads=n_heads,
                                n_kv_heads=n_kv_heads, n_layers=n_layers, tie_embeddings=tie_embeddings,
                                experts=experts, ep=self.ep)

    def check_model_args(self, args) -> None:
        """`check_model` from an object with n_heads / n_kv_heads / n_layers / tie_embeddings
        attributes (the built-in ModelArgs); what it lacks is not checked."""
        self.check_model(**rules.model_shape_of(args))

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
        """fully_shard shards the parameters: over dp_shard, and over the cp ranks with them."""
        return self.dp_shard_enabled or self.cp_enabled

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
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """The dp_shard ranks that hold the same experts: FSDP shards the experts over these."""
        return self.dp_shard // self.ep

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
        if self.ep_enabled:
            on.append(f"ep {self.ep} (of dp_shard)")
        return f"{' x '.join(on) or 'single rank'} (world {self.world_size})"

    # -- the mesh -------------------------------------------------------------------------------

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """One DeviceMesh with axes MESH_AXES plus the flattened "dp" (and "dp_shard_cp" when cp > 1);
        call after the group exists.

        Every rank must call it (it creates the sub-groups collectively).
        """
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(getattr(self, name) for name in MESH_AXES)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
        self.dp_mesh(mesh)  # create the flattened groups now, collectively, on every rank
        if self.cp_enabled:
            self.fsdp_mesh(mesh)
        if self.ep_enabled:
            # dp_shard unflattened into (efsdp, ep), ep innermost (neighbouring ranks): the same
            # ranks, new groups. Kept here: unflattening again would create more groups.
            sparse = mesh["dp_replicate", "dp_shard"]._unflatten(1, (self.efsdp, self.ep), ("efsdp", "ep"))
            self._expert_meshes[id(mesh)] = sparse
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

    def expert_meshes(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """The (dp_replicate, efsdp, ep) mesh `build_mesh` made of `mesh` when ep > 1, else None."""
        return self._expert_meshes.get(id(mesh))

    def ep_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The 1-D "ep" mesh of `mesh` (built by `build_mesh` when ep > 1): the ranks whose
        experts together make all the experts, and between which tokens travel."""
        return self._expert_meshes[id(mesh)]["ep"]

    def expert_fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh fully_shard gets for the routed experts under ep: 1-D "efsdp" (the dp_shard
        ranks holding the same experts), 2-D (dp_replicate, efsdp) with replicas (HSDP)."""
        sparse = self._expert_meshes[id(mesh)]
        return sparse["dp_replicate", "efsdp"] if self.dp_replicate_enabled else sparse["efsdp"]

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh fully_shard gets: 2-D (dp_replicate, dp_shard) for HSDP, else 1-D dp_shard;
        with cp > 1, "dp_shard_cp" (dp_shard x cp flattened) in place of dp_shard, as torchtitan
        does. Idempotent, like `dp_mesh`."""
        if self.cp_enabled:
            flat = mesh["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp")
            if not self.dp_replicate_enabled:
                return flat
            with warnings.catch_warnings():
                # torch 2.13 warns that slicing a flattened axis from the root will go; no public
                # call pairs a root axis with a flattened one yet (torchtitan slices it too).
                warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
                return mesh["dp_replicate", "dp_shard_cp"]
        if self.dp_replicate_enabled:
            return mesh["dp_replicate", "dp_shard"]
        return mesh["dp_shard"]
