"""Mixed precision in every layout, fp16's scaler, and every optimizer and schedule surviving a SIGKILL exactly.

The real trainer (`meshrun.train.trainer.train`) runs in-process on real gloo ranks, several
runs per process start to keep starts few: one 2-rank start trains bf16 under DDP, FSDP, TP
and PP, fp16 under DDP and FSDP (one with a loss scale so large that every step overflows), and
one run per optimizer x schedule pair with a checkpoint at step 3; a 1-rank start trains the
one-process references and resumes the Muon run's FSDP-2 checkpoint on one process (reshard).
Then `meshrun launch --max-restarts 5` trains every pair again, in the same layouts, and kills
each one for real: attempt i's rank 1 SIGKILLs itself right after its optimizer step KILL_AT of
pair i; the agent restarts the group, which resumes pair i from its newest checkpoint (disk or
in-memory snapshot), finishes it and goes on to the next. Each pair's final weights must
equal the uninterrupted run's bit for bit, and its resumed steps' losses too.

Every layout sees the same global batch (8 windows per step). Tolerances, measured here over 6
steps against the fp32 one-process run (see BF16_TOL): bf16 and fp16 autocast keep 8 and 11
mantissa bits of the matmul inputs, so their losses drift from fp32 by a few 1e-4; the same
precision in another layout differs from its one-process run by rounding order only.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import meshrun

from meshrun.testing import run_distributed

pytestmark = pytest.mark.timeout(480)  # three starts and a launch with 5 restarts: ~60 s quiet, 5-7 min at load 15-25

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"
STEPS = 6
BASE = [f"train.steps={STEPS}", "optim.warmup_steps=2", "train.eval_interval=0", "train.eval_steps=1", "metrics.interval=1",
        "metrics.tensorboard=false", "model.tie_embeddings=false", "checkpoint.interval=0"]
ONE = ["train.batch_size=8"]  # the global batch, 8 windows, in every layout
LAYOUTS = {
    "ddp": ["train.batch_size=4"],
    "fsdp": ["train.batch_size=4", "parallel.strategy=fsdp"],
    "tp": ["parallel.strategy=fsdp", "parallel.tp=2"],
    "pp": ["parallel.pp=2"],
}
# bf16 under FSDP is the adamw_cosine pair below; fp16 is checked under FSDP (DTensor gradients,
# the harder case for the scaler); one process and DDP use torch.amp.GradScaler as it is.
PRECISION_RUNS = {"bf16_ddp": [*LAYOUTS["ddp"], "train.dtype=bf16"], "bf16_tp": [*LAYOUTS["tp"], "train.dtype=bf16"],
                  "bf16_pp": [*LAYOUTS["pp"], "train.dtype=bf16"], "fp16_fsdp": [*LAYOUTS["fsdp"], "train.dtype=fp16"]}
OVERFLOW = ["train.batch_size=4", "parallel.strategy=fsdp", "train.dtype=fp16", "train.loss_scale=1e30",
            "train.steps=2"]  # 1e30 x the loss overflows fp16 in every backward: every step is skipped
# Each optimizer once, each schedule at least once; adafactor cannot update DTensor shards
# (meshrun.parallel.rules.check_optimizer_shards), so it runs under DDP.
PAIRS = {
    "adamw_cosine": ["optim.name=adamw", "optim.schedule=cosine", "train.dtype=bf16", *LAYOUTS["fsdp"]],
    "adam_linear": ["optim.name=adam", "optim.schedule=linear", *LAYOUTS["tp"]],
    "sgd_constant": ["optim.name=sgd", "optim.nesterov=true", "optim.schedule=constant", "optim.lr=0.1",
                     *LAYOUTS["fsdp"]],
    "adafactor_wsd": ["optim.name=adafactor", "optim.schedule=wsd", "optim.decay_fraction=0.5", *LAYOUTS["ddp"]],
    "muon_wsd_fp16": ["optim.name=muon", "optim.schedule=wsd", "train.dtype=fp16", *LAYOUTS["fsdp"]],
}
RESUME_AT = 3
KILL_AT = 5  # the optimizer step after which the killed attempt's rank 1 dies (checkpoint at RESUME_AT)
# Measured here, max over the 6 steps: one-process bf16 vs fp32 3.6e-4; bf16 DDP / TP / PP / FSDP
# vs one-process bf16 1.1e-4 / 3.4e-4 / 1.4e-4 / 7.8e-4 (FSDP also all-gathers bf16 weights), vs
# one-process fp32 3.3e-4 / 2.5e-4 / 2.3e-4 / 6.0e-4; fp16 FSDP vs fp32 1.5e-4.
BF16_TOL = 2e-3  # |loss - fp32 one-process loss|, bf16 or fp16, any layout
AUTOCAST_MIN = 1e-5  # ... and above this, or the layout ran without autocast (fp32 layouts match within it)
SAME_DTYPE_TOL = 2e-3  # |loss - bf16 one-process loss|
RESHARD_TOL = 5e-4  # Muon + fp16, FSDP-2 checkpoint resumed on one process; measured 5.7e-5


def _train_runs(root: str, runs: dict[str, list[str]]) -> dict[str, dict]:
    """Train each run in turn on this group; {name: {"losses": {step: loss}, "skipped": [...]}}."""
    import json

    from meshrun.config import load_config
    from meshrun.runtime.process import get
    from meshrun.train.trainer import train

    env = get()
    out = {}
    for name, sets in runs.items():
        cfg = load_config(TINY, [f"train.run_dir={root}", f"train.name={name}", *BASE, *sets])
        run_dir = Path(root) / name
        run_dir.mkdir(parents=True, exist_ok=True)
        result = train(cfg, env, run_dir)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
            if env.rank == 0 else []
        out[name] = {"losses": dict(result.losses),
                     "skipped": [r.get("skipped_steps") for r in rows if r.get("kind") == "train"]}
    return out


def _initial_weights(root: str) -> str:
    """The weights every run starts from (init_weights(seed) is the same in every layout)."""
    from meshrun.config import load_config
    from meshrun.data.tokenizer import load_tokenizer
    from meshrun.models.factory import build_model

    cfg = load_config(TINY, BASE)
    model = build_model(cfg.model, load_tokenizer(cfg.data.tokenizer).vocab_size, seed=cfg.train.seed)
    path = Path(root) / "initial.pt"
    torch.save(model.state_dict(), path)
    return str(path)


def _one_process(root: str, runs: dict[str, list[str]]) -> tuple[dict, str]:
    return _train_runs(root, runs), _initial_weights(root)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


# `meshrun launch` runs this on 2 ranks: every pair in turn, attempt i killing pair i (see the docstring).
KILLED_RUNS = """\
import json, os, signal, sys
from pathlib import Path
from torch.optim.optimizer import register_optimizer_step_post_hook
import meshrun
from meshrun.config import load_config
from meshrun.train.trainer import train

env = meshrun.init()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
spec = json.loads(Path(sys.argv[1]).read_text())
steps = {}

def kill_after(optimizer, args, kwargs):  # every torch optimizer's step, Muon's two halves alike
    steps[id(optimizer)] = steps.get(id(optimizer), 0) + 1
    if steps[id(optimizer)] == spec["kill_at"] and env.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)

for index, (name, sets) in enumerate(spec["runs"].items()):
    run_dir = Path(spec["root"]) / name
    if (run_dir / "model.pt").exists():
        continue  # finished in an earlier attempt
    run_dir.mkdir(parents=True, exist_ok=True)
    steps.clear()
    hook = register_optimizer_step_post_hook(kill_after) if index == attempt else None
    cfg = load_config(spec["config"], [f"train.run_dir={spec['root']}", f"train.name={name}", *spec["base"], *sets])
    result = train(cfg, env, run_dir)
    if hook is not None:
        hook.remove()
    if env.rank == 0:
        (run_dir / f"losses-{attempt}.json").write_text(json.dumps(dict(result.losses)))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run of this file: two process starts and one launch (see the module docstring)."""
    root = tmp_path_factory.mktemp("precision")
    two = {**PRECISION_RUNS, "fp16_overflow": OVERFLOW,
           **{name: [*sets, f"checkpoint.interval={RESUME_AT}"] for name, sets in PAIRS.items()}}
    out = run_distributed(_train_runs, world_size=2, timeout=240, args=(str(root / "two"), two))[0]
    saved = {name: root / "two" / name / "checkpoints" / f"step-{RESUME_AT:08d}" for name in PAIRS}
    one = {f"one_{dtype}": [*ONE, f"train.dtype={dtype}"] for dtype in ("fp32", "bf16")}
    one["reshard_muon"] = [*ONE, *PAIRS["muon_wsd_fp16"][:-2], f"checkpoint.resume={saved['muon_wsd_fp16']}"]
    # One start after another: run_distributed sets each child's RANK/WORLD_SIZE in os.environ.
    one_out, initial = run_distributed(_one_process, world_size=1, timeout=180, args=(str(root / "one"), one))[0]
    out.update(one_out)
    out["killed"] = _killed_runs(root / "killed", {name: two[name] for name in PAIRS})
    out["dirs"] = {"two": root / "two", "one": root / "one", "killed": root / "killed", "initial": Path(initial)}
    yield out
    shutil.rmtree(root, ignore_errors=True)


def _killed_runs(root: Path, runs: dict[str, list[str]]):
    """`meshrun launch` of KILLED_RUNS on 2 processes: one SIGKILL and one restart per pair."""
    root.mkdir()
    spec = root / "spec.json"
    spec.write_text(json.dumps({"root": str(root), "config": str(TINY), "base": BASE, "runs": runs,
                                "kill_at": KILL_AT}))
    (root / "killed_runs.py").write_text(KILLED_RUNS)
    return meshrun("launch", "--nproc-per-node", "2", "--max-restarts", str(len(runs)), "--log-dir", str(root / "logs"),
                   str(root / "killed_runs.py"), str(spec), cwd=root, timeout=300, env={"OMP_NUM_THREADS": "1"})


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1)), (a, b)
    return max(abs(a[s] - b[s]) for s in a)


@pytest.mark.parametrize("name", [*PRECISION_RUNS, "adamw_cosine"])
def test_mixed_precision_trains_like_one_process(runs, name):
    dtype = "bf16" if name == "adamw_cosine" else name.split("_")[0]
    got = runs[name]["losses"]
    if dtype == "bf16":
        assert _max_diff(got, runs["one_bf16"]["losses"]) < SAME_DTYPE_TOL
    assert AUTOCAST_MIN < _max_diff(got, runs["one_fp32"]["losses"]) < BF16_TOL
    assert got[STEPS] < got[1] - 0.3, got  # it trains
    if dtype == "fp16":
        assert runs[name]["skipped"] == [0] * STEPS  # 65536 leaves room: nothing overflows


def test_fp16_overflow_skips_the_step_counts_it_and_leaves_the_weights(runs):
    assert runs["fp16_overflow"]["skipped"] == [1, 2]
    initial = torch.load(runs["dirs"]["initial"], weights_only=True)
    final = _weights(runs["dirs"]["two"] / "fp16_overflow")
    assert final.keys() == initial.keys()
    changed = [k for k in final if not torch.equal(final[k], initial[k])]
    assert not changed, changed


def test_the_launch_killed_each_pair_once_and_finished(runs):
    result = runs["killed"]
    assert result.returncode == 0, result.output[-4000:]
    # One failed attempt per pair. Which rank the line names depends on who the agent saw die first:
    # the SIGKILLed rank 1, or rank 0 raising gloo's 'Connection reset' (seen in CI under load);
    # that the right attempt died is checked per pair (its losses file is missing).
    failed = re.findall(r"^meshrun: attempt (\d+) failed on \S+: local rank ", result.stderr, re.M)
    assert failed == [str(i) for i in range(len(PAIRS))], result.stderr[-4000:]
    assert "killed by SIGKILL" in result.stderr or "ended without a Python error" in result.stderr


@pytest.mark.parametrize("name", list(PAIRS))
def test_each_optimizer_and_schedule_resumes_bitwise_after_a_sigkill(runs, name):
    attempt = list(PAIRS).index(name)
    run_dir = runs["dirs"]["killed"] / name
    assert not (run_dir / f"losses-{attempt}.json").exists(), "the attempt that should have died finished the run"
    losses = json.loads((run_dir / f"losses-{attempt + 1}.json").read_text())
    got = {int(step): loss for step, loss in losses.items()}
    assert RESUME_AT < min(got) <= KILL_AT + 1 and max(got) == STEPS, sorted(got)  # resumed, not restarted
    assert all(got[s] == runs[name]["losses"][s] for s in got), (got, runs[name]["losses"])
    ref, resumed = _weights(runs["dirs"]["two"] / name), _weights(run_dir)
    unequal = [k for k in ref if not torch.equal(ref[k], resumed[k])]
    assert not unequal, unequal[:3]


def test_muon_fp16_checkpoint_reshards_from_fsdp2_to_one_process(runs):
    got, ref = runs["reshard_muon"]["losses"], runs["muon_wsd_fp16"]["losses"]
    assert sorted(got) == list(range(RESUME_AT + 1, STEPS + 1))
    diffs = {s: abs(got[s] - ref[s]) for s in got}
    assert max(diffs.values()) < RESHARD_TOL, diffs
