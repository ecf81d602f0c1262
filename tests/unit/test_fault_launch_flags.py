"""torchft mode: the launch flags a user gave reach every replica group's own `meshrun launch`
(pure argument building, in-process: the command lines are built, nothing is started)."""

from __future__ import annotations

from pathlib import Path

from conftest import TINY

from meshrun.cli.train import check_train_args
from meshrun.fault.launch import group_command
from meshrun.launch.spec import launch_spec


def _commands(tmp_path: Path, *flags: str) -> list[list[str]]:
    _args, cfg, launch_args, options = check_train_args(
        [TINY, "--set", "fault.mode=torchft", "--set", f"train.run_dir={tmp_path}", *flags])
    plan = launch_spec(launch_args, checked=options).with_run(
        log_dir=str(tmp_path / "logs"), script_args=["--run-dir", str(tmp_path / "run"), "--resume", "auto"])
    return [group_command(cfg, plan, tmp_path / "run", group) for group in range(cfg.fault.replica_groups)]


def _launch_flags(command: list[str]) -> list[str]:
    """The flags between `meshrun launch` and its `-m meshrun.train.worker`."""
    start = command.index("launch") + 1
    return command[start:command.index("-m", start)]


def test_user_launch_flags_reach_every_group(tmp_path):
    commands = _commands(tmp_path, "--max-restarts", "4", "--hang-timeout", "45", "--debug", "collectives",
                         "--rank0-only", "--no-prefix", "--monitor-interval", "0.5")
    for group, command in enumerate(commands):
        flags = _launch_flags(command)
        pairs = dict(zip(flags[::2], flags[1::2], strict=False))
        assert flags[:2] == ["--nproc-per-node", "1"], flags  # fault.group_size, not tiny.toml's 2
        assert {"--max-restarts": "4", "--hang-timeout": "45.0", "--debug": "collectives",
                "--monitor-interval": "0.5", "--local-ranks-filter": "0"}.items() <= pairs.items(), flags
        assert "--rank0-only" in flags and "--no-prefix" in flags
        assert pairs["--log-dir"] == str(tmp_path / "logs" / f"replica-{group}")
        assert not any(f.startswith(("--rdzv", "--nnodes", "--master", "--standalone")) for f in flags), flags
        run_dir = command[command.index("--run-dir") + 1]
        assert run_dir == str(tmp_path / "run" if group == 0 else tmp_path / "run" / f"replica-{group}")


def test_flags_left_at_their_defaults_are_not_passed(tmp_path):
    flags = _launch_flags(_commands(tmp_path)[1])
    # --tee 3: what launch_spec makes of no --tee and no --redirects, as each group's own launch would too
    assert flags == ["--nproc-per-node", "1", "--max-restarts", "0", "--tee", "3",
                     "--log-dir", str(tmp_path / "logs" / "replica-1")]


def test_a_finished_group_directory_trains_again(tmp_path: Path):
    """A torchft run trained further (a higher train.steps and --force): group 1's directory had
    finished too, and its workers would exit at once ("has finished; not training it again")
    leaving group 0 alone. Its final weights are set aside as the run's are."""
    from meshrun.fault.launch import reopen_group
    from meshrun.rundir.runs import FINAL_WEIGHTS, finished_step, write_finished

    gdir = tmp_path / "replica-1"
    gdir.mkdir()
    (gdir / FINAL_WEIGHTS).write_bytes(b"weights of step 20")
    write_finished(gdir, 20)
    reopen_group(gdir)
    assert finished_step(gdir) is None
    assert (gdir / "model.step-00000020.pt").read_bytes() == b"weights of step 20"
    reopen_group(gdir)  # an unfinished group: nothing to do
    assert sorted(p.name for p in gdir.iterdir()) == ["model.step-00000020.pt"]
