"""Pipeline planning and stage splitting, in one process: checks that fail before any group exists."""

from __future__ import annotations

import pytest

from meshrun.config import load_config
from meshrun.errors import ConfigError
from meshrun.models.llama import ModelArgs, Transformer
from meshrun.parallel.pipeline import stage_module
from meshrun.parallel.rules_pp import SCHEDULES, resolve_pipeline, split_layers
from meshrun.plan.show import stage_of_block


def _plan(**kw):
    base = dict(pp=2, schedule="gpipe", stages_per_rank=0, split_points="", n_layers=4, batch_size=8,
                microbatches=0)
    return resolve_pipeline(**{**base, **kw})


def test_config_takes_exactly_the_supported_schedules():
    for name in SCHEDULES:
        assert load_config(None, [f"parallel.pp_schedule={name}"]).parallel.pp_schedule == name
    with pytest.raises(ConfigError, match="parallel.pp_schedule must be one of 'gpipe', '1f1b'"):
        load_config(None, ["parallel.pp_schedule=zbv"])


def test_balanced_split_matches_the_planner_and_user_split_points_cut_before_a_block():
    for n_layers, stages in ((4, 2), (5, 2), (7, 3), (8, 4)):
        split = split_layers(n_layers, stages)
        assert [b for s in split for b in s] == [str(i) for i in range(n_layers)]
        for stage, blocks in enumerate(split):
            assert all(stage_of_block(int(b), n_layers, stages) == stage for b in blocks)
    assert split_layers(4, 2, "1") == [["0"], ["1", "2", "3"]]
    assert split_layers(6, 3, "layers.1, layers.5") == [["0"], ["1", "2", "3", "4"], ["5"]]


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        (dict(split_points="2,3"), "gives 3 stages, but the layout has 2"),
        (dict(split_points="4"), "increasing block indices in 1..3"),
        (dict(split_points="x"), "'x' is not a block index"),
        (dict(schedule="zbv"), "parallel.pp_schedule must be one of 'gpipe', "),
        (dict(schedule="interleaved_1f1b", stages_per_rank=1), "interleaves several stages per rank"),
        (dict(schedule="1f1b", stages_per_rank=2), "runs one stage per rank"),
        (dict(pp=4, schedule="interleaved_1f1b"), "= 8 stages exceeds model.n_layers=4"),
        (dict(pp=8), "parallel.pp=8 exceeds model.n_layers=4 (a stage needs at least one block)"),
        (dict(microbatches=3), "parallel.pp_microbatches=3 does not divide train.batch_size=8"),
        (dict(schedule="1f1b", microbatches=1), "needs parallel.pp_microbatches >= the 2 stages"),
        (dict(schedule="interleaved_zero_bubble", dp_size=2), "does not train correctly with data parallel"),
        (dict(schedule="interleaved_1f1b", batch_size=10, microbatches=5), "a multiple of parallel.pp=2"),
    ],
)
def test_bad_pipeline_layouts_are_one_config_error(kw, expected):
    with pytest.raises(ConfigError, match=None) as info:
        _plan(**kw)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_interleaved_stages_loop_over_the_ranks():
    plan = _plan(schedule="interleaved_1f1b")
    assert (plan.num_stages, plan.stages_per_rank, plan.microbatches) == (4, 2, 4)
    assert plan.stage_ids(0, 2) == [0, 2] and plan.stage_ids(1, 2) == [1, 3]


def test_stage_modules_keep_original_names_and_together_hold_the_model():
    model = Transformer(ModelArgs(vocab_size=32, dim=16, n_layers=3, n_heads=2, max_seq_len=8), seed=0)
    layers = split_layers(3, 2)
    first, last = (stage_module(model, s, 2, layers[s]) for s in range(2))
    assert first.output is None and first.norm is None and last.tok_embeddings is None
    names = [set(dict(m.named_parameters())) for m in (first, last)]
    assert names[0].isdisjoint(names[1]) and names[0] | names[1] == set(dict(model.named_parameters()))
    assert "layers.2.attention.wq.weight" in names[1]


def test_tied_embeddings_are_refused_under_pp():
    model = Transformer(ModelArgs(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8,
                                  tie_embeddings=True), seed=0)
    with pytest.raises(ConfigError, match="tie_embeddings"):
        stage_module(model, 0, 2, ["0"])
