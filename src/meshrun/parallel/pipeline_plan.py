"""`PipelinePlan`: a resolved pipeline layout, the value `meshrun.parallel.rules_pp.plan_pipeline`
returns and the build follows. Pure Python, no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelinePlan:
    """What a pipeline layout is, resolved and checked before any process group exists."""

    schedule: str
    num_stages: int
    stages_per_rank: int
    microbatches: int
    layers: list[list[str]]
    """Block names (keys of model.layers) per stage, in stage order; [] when planned without
    the model's depth (checks only: resolve again with the model to build)."""

    def stage_ids(self, pp_rank: int, pp: int) -> list[int]:
        """The stages this pipeline rank holds, in the order the schedule wants them."""
        return [pp_rank + k * pp for k in range(self.stages_per_rank)]
