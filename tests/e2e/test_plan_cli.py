"""`meshrun plan` end to end, in process through the dispatcher: flags, table, errors."""

from __future__ import annotations

import pytest

from meshrun import cli


@pytest.fixture
def run(monkeypatch, capsys):
    # Registered here too, so the test runs before and after the COMMANDS entry exists.
    monkeypatch.setitem(cli.COMMANDS, "plan", ("meshrun.cli.plan", "memory per rank of each layout"))

    def _run(*argv: str) -> tuple[int, str, str]:
        code = cli.main(["plan", *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return _run


def test_plan_table_and_recommendation(run):
    code, out, err = run("--model", "tiny", "--world", "4", "--device-memory", "1",
                         "--batch-size", "4", "--seq-len", "64", "--dtype", "bf16")
    assert code == 0, err
    assert "dp_rep  dp_shard  tp  pp  params  grads  optim" in out
    assert "9 layouts" in out and "fits" in out and " yes" in out
    # a tiny model: replicas, not shards, and sizes in MiB so that the columns differ
    assert "MiB per rank, 9 layouts" in out and " 0.000  0.000 " not in out
    assert "recommended: dp_replicate=4 dp_shard=1 tp=1 pp=1" in out and "replicas (DDP) beat sharding" in out
    assert '[parallel]\nstrategy = "ddp"\ndp_replicate = 4\ndp_shard = 1\ntp = 1\npp = 1' in out
    # a model whose training state is GiBs: sharded, in GiB
    code, out, err = run("--model", "1b", "--world", "4", "--batch-size", "1", "--seq-len", "512")
    assert code == 0, err
    assert "GiB per rank" in out and "recommended: dp_replicate=1 dp_shard=4 tp=1 pp=1" in out


def test_plan_places_the_configs_resolved_layout_in_the_table(run):
    code, out, err = run("--model", "tiny", "--world", "4", "--set", "parallel.strategy=fsdp")
    assert code == 0, err
    assert "config [parallel] on 4 ranks: fsdp: dp_shard 4 (world 4); params fp32, reduce fp32 (row " in out
    code, out, err = run("--model", "tiny", "--world", "4", "--set", "parallel.strategy=fsdp", "--set", "parallel.tp=4")
    assert code == 0, err  # the table is still useful: it shows what would fit
    assert "config [parallel] on 4 ranks: refused (parallel.tp=4 does not divide model.n_kv_heads=2" in out


def test_plan_reads_config(run, tmp_path):
    config = tmp_path / "job.toml"
    config.write_text('[model]\nname = "small"\n[train]\nbatch_size = 2\n[data]\nseq_len = 64\n')
    code, out, err = run(str(config), "--world", "2", "--set", "train.dtype=bf16")
    assert code == 0, err
    assert "dim 384" in out and "batch 2 x seq 64" in out and "bf16" in out


def test_plan_show_tp2_dp_shard2(run):
    code, out, err = run("--show", "--model", "tiny", "--world", "4",
                         "--set", "parallel.strategy=fsdp", "--set", "parallel.dp_replicate=1",
                         "--set", "parallel.dp_shard=2", "--set", "parallel.tp=2")
    assert code == 0, err
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith(("layers.0", "tok_"))}
    assert "Shard(0), Shard(0)" in lines["layers.0.attention.wq.weight"]
    assert "[32, 128] on ranks 0-3" in lines["layers.0.attention.wq.weight"]
    assert "Shard(0), Shard(1)" in lines["layers.0.feed_forward.w2.weight"]
    assert "[64, 192] on ranks 0-3" in lines["layers.0.feed_forward.w2.weight"]
    assert "[65, 128] on ranks 0-2; [64, 128] on ranks 3" in lines["tok_embeddings.weight"]


def test_plan_show_prints_the_resolved_layout_for_the_launch_world(run):
    code, out, err = run("--show", "--model", "tiny", "--set", "parallel.strategy=fsdp",
                         "--set", "launch.nproc_per_node=2", "--set", "parallel.pp=2", "--set", "train.batch_size=8")
    assert code == 0, err
    assert out.splitlines()[0] == ("resolved: fsdp: pp 2 (world 2); pipeline gpipe, 2 stages (1 per rank), "
                                   "2 micro-batches; params fp32, reduce fp32")
    assert "stage 1" in out


@pytest.mark.parametrize("argv,message", [
    (("--model", "tinyy", "--world", "4"), "--model='tinyy' is not a known model size; did you mean 'tiny'?"),
    (("--model", "tiny", "--world", "0"), "--world must be >= 1, got 0"),
    (("--model", "tiny"), "--world N is required"),
    (("--model", "small", "--world", "2", "--device-memory", "0.01"),
     "no layout of 2 ranks fits in 0.01 GiB per device; the smallest needs"),
    (("--show", "--world", "4", "--set", "parallel.strategy=fsdp", "--set", "parallel.tp=4",
      "--set", "parallel.dp_replicate=1"), "parallel.tp=4 does not divide model.n_kv_heads=2; valid: 1, 2"),
    (("--show", "--set", "parallel.strategy=fsdp"), "--show needs --world N (or a number in launch.nproc_per_node): "
     "parallel.dp_shard is -1, the ranks left"),
    (("--show", "--world", "2", "--set", "parallel.pp=2", "--set", "parallel.pp_microbatches=3"),
     "parallel.pp_microbatches=3 does not divide train.batch_size=16"),
])
def test_plan_errors_are_one_line(run, argv, message):
    code, _, err = run(*argv)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1
