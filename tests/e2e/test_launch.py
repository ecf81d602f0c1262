"""`meshrun launch` end to end: real agents, real gloo workers, real failures."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import BIN, EXAMPLES, meshrun, run_proc

from meshrun.launch.ports import PORT_RANGE_VAR, QUIET_POOL, quiet_pool_usable
from meshrun.testing.processes import kill_tree

FAILING_SCRIPT = """\
import os, signal, sys, time
import torch, torch.distributed as dist
import meshrun

env = meshrun.init()
mode = sys.argv[1]
for step in range(20):
    x = torch.ones(4)
    if env.rank == 1 and step == 3:
        print("rank 1 reached step 3", flush=True)
        if mode == "raise":
            raise ValueError(f"bad batch at step {step}")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(x)
print("finished")
"""


def _seeded_plain_script() -> str:
    # The guide's model init is unseeded; seed it so the two launchers' runs are comparable.
    source = (EXAMPLES / "guide" / "train_ddp_plain.py").read_text()
    seeded = source.replace("    rank = dist.get_rank()\n", "    rank = dist.get_rank()\n    torch.manual_seed(0)\n")
    assert seeded != source
    return seeded


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory):
    """Two `meshrun launch` jobs started together, each with its own TMPDIR: the guide's DDP example
    on 4 processes ("guide4", in its own directory) and the seeded torchrun-style script on 2
    ("plain", CKPT_PATH=meshrun.pth). Three tests read them: the 4-process example, the torchrun
    comparison (meshrun's side) and the two jobs at once (one launch each, not three tests' worth)."""
    root = tmp_path_factory.mktemp("two_jobs")
    (root / "plain").mkdir()
    (root / "plain" / "train_ddp_plain.py").write_text(_seeded_plain_script())
    commands = {
        "guide4": (["launch", "--nproc-per-node", "4", str(EXAMPLES / "guide" / "train_ddp.py")], {}),
        "plain": (["launch", "--nproc-per-node", "2", str(root / "plain" / "train_ddp_plain.py")],
                  {"CKPT_PATH": str(root / "plain" / "meshrun.pth")}),
    }
    results, errors = {}, {}

    def job(name):
        args, env = commands[name]
        (root / name / "tmp").mkdir(parents=True)
        try:
            results[name] = meshrun(*args, cwd=root / name, timeout=180,
                                    env={**env, "TMPDIR": str(root / name / "tmp")})
        except BaseException as exc:  # run_proc's pytest.fail on a timeout: raised here, not lost in the thread
            errors[name] = exc

    threads = [threading.Thread(target=job, args=(n,)) for n in commands]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for exc in errors.values():
        raise exc
    return root, results


def test_guide_ddp_example_trains_on_4_processes(two_jobs):
    root, results = two_jobs
    result = results["guide4"]
    assert result.returncode == 0, result.output
    epochs = re.findall(r"^\[rank 0\] epoch (\d) loss=([\d.]+) \(world_size=4, gloo\)$", result.stdout, re.M)
    assert [e for e, _ in epochs] == ["0", "1", "2"], result.output
    assert "[rank 1] epoch" not in result.stdout  # printing is rank 0's job
    state = torch.load(root / "guide4" / "ckpt.pth", weights_only=True)
    assert set(state) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # saved without the DDP wrapper


def test_guide_ddp_example_runs_as_one_process_under_plain_python(tmp_path):
    result = run_proc([sys.executable, str(EXAMPLES / "guide" / "train_ddp.py"), "--epochs", "1"],
                      cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.output
    assert "epoch 0 loss=" in result.stdout and "world_size=1" in result.stdout
    notices = [line for line in result.stderr.splitlines() if "single process" in line]
    assert len(notices) == 1, result.stderr


def test_plain_torchrun_script_runs_the_same_under_meshrun_and_torchrun(two_jobs):
    root, results = two_jobs
    tmp_path = root / "plain"
    script = str(tmp_path / "train_ddp_plain.py")
    ours = results["plain"]  # meshrun launch --nproc-per-node 2 with CKPT_PATH=meshrun.pth (two_jobs)
    for _ in range(3):
        theirs = run_proc([str(BIN / "torchrun"), "--nproc-per-node", "2", script], cwd=tmp_path, timeout=180,
                          env={"CKPT_PATH": str(tmp_path / "torchrun.pth")})
        # Plain torchrun on gloo + DDP aborts at exit now and then (measured here: 1 of 10 runs at 2
        # processes; measured again: 2 of 10 at 4, and CI saw it at 2). That is the baseline's flaw,
        # not meshrun's: meshrun launch ran the same script 30 of 30 clean at 4. Only that abort
        # earns the baseline a retry.
        if theirs.returncode == 0 or "terminate called without an active exception" not in theirs.stderr:
            break
    assert ours.returncode == 0, ours.output
    assert theirs.returncode == 0, theirs.output
    a = torch.load(tmp_path / "meshrun.pth", weights_only=True)
    b = torch.load(tmp_path / "torchrun.pth", weights_only=True)
    for key in a:
        assert torch.equal(a[key], b[key]), key  # same seeds, same sampler: bit-identical training
    losses = lambda out: re.findall(r"epoch \d loss=[\d.]+", out)  # noqa: E731
    assert losses(ours.stdout) == losses(theirs.stdout) and len(losses(ours.stdout)) == 3


MAIN_PROBE = """\
import json, os, sys, traceback
os.chdir(sys.argv[1])  # then find a file next to the script, as pytorch/examples' scripts do
with open(os.path.join(os.path.dirname(__file__), "data.txt")) as fp:
    data = fp.read()
print("probe", json.dumps({
    "argv0": sys.argv[0], "file": __file__, "loader": type(__loader__).__name__,
    "loader_name": __loader__.name, "spec": repr(__spec__), "package": repr(__package__),
    "builtins": type(__builtins__).__name__, "path0": sys.path[0], "data": data,
    "line": traceback.extract_stack(limit=1)[0].line,  # the frame's own file, read after the chdir
}), flush=True)
"""


def test_a_script_sees_main_as_under_torchrun_and_python(tmp_path):
    # torchrun runs `python -u script.py`: __file__ absolute, a SourceFileLoader, sys.argv[0] as
    # given. A script that changes directory and then opens a file next to it from __file__ must
    # work the same under meshrun, given by a relative path from another directory.
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "probe.py").write_text(MAIN_PROBE)
    (tmp_path / "sub" / "data.txt").write_text("beside the script")
    for name in ("run", "elsewhere/deeper"):  # ../sub/data.txt exists from run/, not from deeper/
        (tmp_path / name).mkdir(parents=True)
    args = [str(Path("..") / "sub" / "probe.py"), str(tmp_path / "elsewhere" / "deeper")]
    plain = run_proc([sys.executable, *args], cwd=tmp_path / "run", timeout=30)
    theirs = run_proc([str(BIN / "torchrun"), "--nproc-per-node", "1", *args], cwd=tmp_path / "run", timeout=60)
    ours = meshrun("launch", "--nproc-per-node", "1", *args, cwd=tmp_path / "run", timeout=60)
    for result in (plain, theirs, ours):
        assert result.returncode == 0, result.output
    probe = lambda out: json.loads(re.search(r"^(?:\[rank 0\] )?probe (.*)$", out, re.M).group(1))  # noqa: E731
    expected = probe(plain.stdout)
    assert probe(theirs.stdout) == expected, theirs.output
    assert probe(ours.stdout) == expected, ours.output
    assert expected["file"] == str(tmp_path.resolve() / "run" / ".." / "sub" / "probe.py")  # absolute, as given
    assert expected["argv0"] == args[0]
    assert expected["loader"] == "SourceFileLoader" and expected["loader_name"] == "__main__"
    assert expected["data"] == "beside the script" and expected["line"]  # its source found after the chdir
    assert expected["path0"] == str((tmp_path / "sub").resolve())


def test_two_jobs_started_together_both_succeed(two_jobs):
    root, results = two_jobs  # the 4-process guide example and the 2-process torchrun-style script, at once
    assert set(results) == {"guide4", "plain"}
    for name, result in results.items():
        assert result.returncode == 0, f"job {name}: {result.output}"
        # a clean run leaves no temp log directory behind (a failed one keeps it: the test below)
        assert not list((root / name / "tmp").glob("meshrun-launch-*")), f"job {name}"


def test_rank_raising_is_summarized_with_rank_type_message_and_site(write_script):
    # Rank 0 fails a moment later (connection closed by the dead peer), and the agent may SIGTERM
    # rank 1 while it is still exiting: either way rank 1 raised, and the summary must say so
    # (the exact inputs of that race: tests/unit/test_launch_failure.py).
    script = write_script("fails.py", FAILING_SCRIPT)
    result = meshrun("launch", "--nproc-per-node", "2", str(script), "raise", timeout=120)
    assert result.returncode == 1, result.output  # the rank's own exit code, whatever the agent sent it
    headline = next(line for line in result.stderr.splitlines() if "failed first" in line)
    assert "Rank 1 failed first" in headline and "raised ValueError" in headline, result.stderr
    assert "killed by" not in headline, result.stderr
    assert "ValueError: bad batch at step 3" in result.stderr
    assert f"at {script}:12 in <module>" in result.stderr, result.stderr
    assert "rank 1 reached step 3" in result.stderr.split("failed first")[1]  # last output lines
    kept = re.search(r"rank 1's full output: (\S+/attempt_0/1/stderr\.log)", result.stderr)
    assert kept and Path(kept[1]).is_file(), result.stderr  # the failed job's temp log directory stays


def test_rank_killed_by_sigkill_is_named(write_script):
    script = write_script("killed.py", FAILING_SCRIPT)
    result = meshrun("launch", "--nproc-per-node", "2", str(script), "kill", timeout=120)
    assert result.returncode == 128 + 9, result.output
    headline = next(line for line in result.stderr.splitlines() if "failed first" in line)
    assert "Rank 1 failed first" in headline and "SIGKILL" in headline, result.stderr


def test_module_target_and_rank0_only(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "hello.py").write_text(
        "import os, sys, meshrun\nenv = meshrun.init()\n"
        "print(f'hello from {env.rank} of {env.world_size}', sys.argv[1:], 'port', os.environ['MASTER_PORT'])\n"
    )
    result = meshrun("launch", "--nproc-per-node", "2", "--rank0-only", "-m", "mypkg.hello", "x",
                     cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.output
    assert "[rank 0] hello from 0 of 2 ['x']" in result.stdout
    assert "hello from 1" not in result.stdout
    # rank 0's store port is one the OS never hands out by itself (below the ephemeral range), so no
    # outgoing connection can take it between the agent's choice and rank 0's bind: this test
    # worker's own range when one is set (conftest), else the launcher's pool
    port = int(re.search(r"port (\d+)", result.stdout).group(1))
    spec = os.environ.get(PORT_RANGE_VAR)
    if spec or quiet_pool_usable():
        lo, hi = map(int, spec.split("-")) if spec else QUIET_POOL
        assert lo <= port <= hi, (port, lo, hi)


def test_busy_master_port_is_refused_in_one_line(write_script):
    import socket

    script = write_script("noop.py", "print('never runs')\n")
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        result = meshrun("launch", "--nproc-per-node", "2", "--master-port", str(port), str(script), timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {port} is already in use" in lines[0] and "--master-port" in lines[0]


def test_missing_script_is_one_line():
    result = meshrun("launch", "--nproc-per-node", "2", "does_not_exist.py", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "not found" in result.stderr


@pytest.mark.parametrize("args", [["--help"], ["launch", "--help"]])
def test_help_explains_itself(args):
    result = meshrun(*args, timeout=60)
    assert result.returncode == 0
    assert "launch" in result.stdout and "example" in result.stdout
    if args[0] == "launch":
        for flag in ("--nproc-per-node", "--rdzv-endpoint", "--max-restarts", "--rank0-only", "auto"):
            assert flag in result.stdout


def test_min_world_size_under_plain_python_gives_the_launch_command(write_script):
    script = write_script("needs2.py", "import meshrun\nmeshrun.init(min_world_size=2)\nprint('ran')\n")
    result = run_proc([sys.executable, str(script), "--lr", "3"], timeout=60)
    assert result.returncode == 2 and "ran" not in result.stdout
    (line,) = result.stderr.strip().splitlines()
    assert f"meshrun launch --nproc-per-node 2 {script} --lr 3" in line


def test_sys_exit_nonzero_on_one_rank_fails_the_job_fast(write_script):
    script = write_script("exits.py", "import sys, meshrun\nenv = meshrun.init()\n"
                                      "if env.rank == 1:\n    sys.exit(3)\nprint('rank', env.rank, 'done')\n")
    # A failing rank that sat in the shutdown barrier would hold the job until the collective
    # timeout (10 min by default here): the 120 s bound catches that; how fast it ends is not asserted.
    result = meshrun("launch", "--nproc-per-node", "2", str(script), timeout=120)
    assert result.returncode == 3, result.output
    assert "Rank 1 failed first" in result.stderr and "exit code 3" in result.stderr


LEAVES_EARLY = """\
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=20))  # a bound should the peers not notice
dist.barrier()
if dist.get_rank() == 1:
    time.sleep(0.5)  # the others are waiting in the all_reduce by now
    print("rank 1 leaves", flush=True)
    os._exit(int(sys.argv[1]))  # no traceback, no error file
dist.all_reduce(torch.ones(1))
"""


@pytest.mark.parametrize(("code", "nproc"), [(0, 3), (3, 2)])
def test_the_rank_that_left_while_the_others_waited_is_named(write_script, code, nproc):
    # Exit code 0 is no failure to torch's agent: only the waiting ranks' 'Connection closed by peer'
    # was on record, and the summary blamed one of them. The agent's exit records name rank 1.
    script = write_script("leaves.py", LEAVES_EARLY)
    result = meshrun("launch", "--nproc-per-node", str(nproc), str(script), str(code), timeout=90)
    assert result.returncode == (code or 1), result.output
    headline = next(line for line in result.stderr.splitlines() if line.startswith("meshrun: job failed."))
    if code == 0:
        assert "Rank 1 left first" in headline and "exited with code 0" in headline, result.stderr
        assert "while ranks 0, 2 still ran" in headline, result.stderr
        assert "fix: a rank left the training loop early" in result.stderr, result.stderr
    else:
        assert "Rank 1 failed first" in headline and "exit code 3" in headline, result.stderr
        assert "no Python error was recorded" in result.stderr, result.stderr
    assert "Connection" not in headline and "RuntimeError" not in headline, result.stderr
    summary = result.stderr.split(headline)[1]
    assert "rank 1 leaves" in summary  # rank 1's last lines
    consequences = summary.split("then, as a consequence:")[1].split("full output")[0]
    assert all(f"rank {r}:" in consequences for r in range(nproc) if r != 1), result.stderr


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fp:
            return fp.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_workers_die_with_a_sigkilled_agent(tmp_path, write_script):
    import os
    import signal
    import subprocess

    script = write_script("sleeper.py", "import os, sys, time\n"
                          "open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').write(str(os.getpid()))\n"
                          "time.sleep(120)\n")
    agent = subprocess.Popen([str(BIN / "meshrun"), "launch", "--nproc-per-node", "2", str(script), str(tmp_path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all((tmp_path / r).exists() for r in "01"):
            time.sleep(0.2)
        pids = [int((tmp_path / r).read_text()) for r in "01"]
        agent.kill()
        agent.wait(timeout=10)
        deadline = time.monotonic() + 10
        alive = pids
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [p for p in pids if _alive(p)]
        assert not alive, f"workers {alive} outlived the agent"
    finally:
        agent.kill()
        for r in "01":
            if (tmp_path / r).exists():
                try:
                    os.kill(int((tmp_path / r).read_text()), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass


def test_sigterm_to_the_agent_stops_everything_with_one_line(tmp_path):
    script = tmp_path / "wait.py"
    script.write_text("import time, meshrun\nmeshrun.init()\nprint('ready', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([str(BIN / "meshrun"), "launch", "--nproc-per-node", "2", str(script)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "ready" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert "ready" in line, proc.stderr.read()
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err and "Traceback" not in err, err
