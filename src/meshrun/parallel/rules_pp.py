"""A pipeline's rules and its resolved value: schedules, stages per rank, micro-batches, split points.

Pure Python, no torch, like `meshrun.parallel.rules` (whose helpers and stage checks it uses);
the schedules themselves, and the papers they come from, are `meshrun.parallel.pipeline`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.errors import ConfigError
from meshrun.parallel.rules import _listing, check_choice, check_stages, divisors


@dataclass(frozen=True)
class ResolvedPipeline:
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


# meshrun name -> (torch class name for get_schedule_class, several stages per rank).
# Left out, measured on torch 2.13 / gloo: ZBVZeroBubble trains right without data parallel but
# its `eval()` fails ("can't steal_bwd_input"), and DualPipeV needs overlapped F/B callbacks.
SCHEDULES: dict[str, tuple[str, bool]] = {
    "gpipe": ("GPipe", False),
    "1f1b": ("1F1B", False),
    "interleaved_1f1b": ("Interleaved1F1B", True),
    "looped_bfs": ("LoopedBFS", True),
    "interleaved_zero_bubble": ("InterleavedZeroBubble", True),
}
# Zero bubble splits each backward into input and weight gradients; with fully_shard data
# parallel the losses drift from one process (3.8629 vs 3.8645 at step 2 here), so it is
# refused with dp > 1.
ZERO_BUBBLE = ("interleaved_zero_bubble",)



def default_stages_per_rank(schedule: str, requested: int = 0) -> int:
    """The stages each pipeline rank holds: `requested`, or for 0: 1 for single-stage schedules,
    2 for the interleaved ones."""
    check_choice("parallel.pp_schedule", schedule, SCHEDULES)
    return requested or (2 if SCHEDULES[schedule][1] else 1)


def resolve_pipeline(*, pp: int, schedule: str, stages_per_rank: int, split_points: str,
                  n_layers: int | None, batch_size: int, microbatches: int, dp_size: int = 1,
                  world_size: int | None = None) -> ResolvedPipeline:
    """Resolve and check a pipeline layout; every problem is one ConfigError naming the key.

    stages_per_rank 0 = 1 for single-stage schedules, 2 for the others. split_points '' =
    balanced (later stages take the remainder), else the first block of each stage after the
    first, e.g. '1' or 'layers.1' for pp=2. microbatches 0 = one per stage. n_layers None =
    the depth is not known (a user model): the split is left empty.
    """
    per_rank = default_stages_per_rank(schedule, stages_per_rank)
    multi = SCHEDULES[schedule][1]
    if schedule in ZERO_BUBBLE and dp_size > 1:
        raise ConfigError(f"parallel.pp_schedule={schedule!r} does not train correctly with data "
                          f"parallel ({dp_size} dp ranks) on torch 2.13; use 'interleaved_1f1b', "
                          "or give the ranks to parallel.pp / parallel.tp")
    if multi and per_rank < 2:
        raise ConfigError(f"parallel.pp_schedule={schedule!r} interleaves several stages per rank, "
                          f"but parallel.pp_stages_per_rank={per_rank}; set it to 2 or more "
                          "(or 0 for 2), or use 'gpipe' / '1f1b'")
    if not multi and per_rank != 1:
        raise ConfigError(f"parallel.pp_schedule={schedule!r} runs one stage per rank, but "
                          f"parallel.pp_stages_per_rank={per_rank}; use 1 (or 0), or an interleaved "
                          "schedule such as 'interleaved_1f1b'")
    num_stages = pp * per_rank
    check_stages(pp, n_layers, world_size or pp, per_rank)
    layers = split_layers(n_layers, num_stages, split_points) if n_layers is not None else []
    n_micro = microbatches or num_stages
    if batch_size % n_micro:
        raise ConfigError(f"parallel.pp_microbatches={n_micro} does not divide train.batch_size="
                          f"{batch_size}; valid: {_listing(divisors(batch_size))}")
    if schedule == "1f1b" and n_micro < num_stages:
        raise ConfigError(f"parallel.pp_schedule='1f1b' needs parallel.pp_microbatches >= the "
                          f"{num_stages} stages, got {n_micro}")
    rounds = max(1, n_micro // pp)  # torch's interleaved schedules run rounds of pp micro-batches
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and n_micro % rounds:
        raise ConfigError(f"parallel.pp_microbatches={n_micro} must be a multiple of parallel.pp={pp} "
                          f"(or at most {pp}) for {schedule!r}")
    return ResolvedPipeline(schedule, num_stages, per_rank, n_micro, layers)


def split_layers(n_layers: int, num_stages: int, split_points: str = "") -> list[list[str]]:
    """Block names per stage: balanced, or cut before each block index in `split_points`."""
    if not split_points.strip():
        # Stage s takes blocks [s*n/S, (s+1)*n/S): later stages get the remainder, the rule
        # `meshrun plan` counts memory with (meshrun.plan.show.stage_of_block).
        cuts = [s * n_layers // num_stages for s in range(1, num_stages)]
    else:
        cuts = []
        for item in split_points.split(","):
            text = item.strip().removeprefix("layers.")
            if not text.isdigit():
                raise ConfigError(f"parallel.pp_split_points={split_points!r}: {item.strip()!r} is not a "
                                  "block index; write e.g. '2' or 'layers.2,layers.5'")
            cuts.append(int(text))
        if len(cuts) != num_stages - 1:
            raise ConfigError(f"parallel.pp_split_points={split_points!r} gives {len(cuts) + 1} stages, "
                              f"but the layout has {num_stages}; list {num_stages - 1} block indices")
        if cuts != sorted(set(cuts)) or cuts[0] < 1 or cuts[-1] >= n_layers:
            raise ConfigError(f"parallel.pp_split_points={split_points!r} must be increasing block "
                              f"indices in 1..{n_layers - 1}, so every stage keeps a block")
    bounds = [0, *cuts, n_layers]
    return [[str(i) for i in range(bounds[s], bounds[s + 1])] for s in range(num_stages)]
