"""Shared helpers and fixtures: run meshrun's CLI and scripts as real processes, always bounded and reaped.

Test files import the helpers by name (`from conftest import meshrun, train_tiny`); pytest puts
tests/ on sys.path because this file sits there. Keep every helper that two test files need here,
once, rather than a copy in each file.
"""

from __future__ import annotations

import atexit
import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshrun.testing.ports import PORT_RANGE_VAR, pick_port, worker_range
from meshrun.testing.processes import kill_tree

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
BIN = Path(sys.executable).parent
TINY = str(EXAMPLES / "configs" / "tiny.toml")  # the config the end-to-end tests train
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def pytest_configure(config) -> None:
    """Under pytest-xdist (`make test` runs 3 workers), each worker picks its store ports from its
    own range (meshrun.testing.ports): two workers can never pick the same port at once.

    SIGINT handled as Python does by default, whatever this process inherited: a suite started in
    the background by a shell without job control (`make test &` in a script) inherits SIGINT
    ignored, every process a test starts would inherit that too, and the tests' Ctrl-Cs would reach
    nothing (`meshrun train` then rightly trains on, as under nohup: a test failure, not a bug)."""
    import signal

    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and PORT_RANGE_VAR not in os.environ:
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        os.environ[PORT_RANGE_VAR] = worker_range(int(worker[2:]), max(count, int(worker[2:]) + 1))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    """Tests that compute in this process (references, unit tests) use one torch thread, as every
    rank does: on 2 cores, torch's second OpenMP thread only spins against the ranks and the other
    worker (the parallel matrix's reference: 1.1 s of CPU on one thread, 8.5 s on two, under load)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


_FILE_TIMES: dict[str, list[float]] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """MESHRUN_SUITE_TIMES=PATH: each test file's wall time, CPU time, worker and first start / last end (this process, plus the
    children it has reaped: CLI runs; ranks forked from the harness's forkserver are counted only
    when that server exits) appended to PATH as JSON lines, one per file, at the end of the session."""
    if not os.environ.get("MESHRUN_SUITE_TIMES"):
        yield
        return
    import resource

    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    wall, used, start = time.monotonic(), cpu(), time.time()
    yield
    entry = _FILE_TIMES.setdefault(item.nodeid.split("::")[0], [0.0, 0.0, start, 0.0])
    entry[0] += time.monotonic() - wall
    entry[1] += cpu() - used
    entry[3] = time.time()


def pytest_sessionfinish(session) -> None:
    path = os.environ.get("MESHRUN_SUITE_TIMES")
    if path and _FILE_TIMES:
        with open(path, "a") as out:
            for name, (wall, used, start, end) in _FILE_TIMES.items():  # start/end: when (epoch s), for the workers' timelines
                out.write(json.dumps({"file": name, "wall_s": round(wall, 2), "cpu_s": round(used, 2),
                                      "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
                                      "start": round(start, 1), "end": round(end, 1)}) + "\n")
            out.write(json.dumps({"file": "(meshrun commands)", **_WARM_COUNTS,
                                  "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")


def free_port() -> int:
    """A port for a test to name up front (--rdzv-endpoint, MESHRUN_RDZV_PORT): this worker's own."""
    return pick_port("127.0.0.1")


def child_env(*extra: dict[str, str | None] | None) -> dict[str, str]:
    """This process's environment without the variables a launcher sets, then each of `extra` on top
    (a None value removes the variable).

    A test run under a launcher (or by a rank) must not hand its own rank to the processes it starts.
    OMP_NUM_THREADS is 1 unless `extra` says otherwise, as in this process (pytest_runtest_setup):
    a one-process run or tool on 2 cores shared with the other test worker only spins its second
    OpenMP thread (`meshrun train tiny.toml --nproc-per-node 1` under load: 10-17 CPU-s on two
    threads, 6 on one). Launches of several processes get 1 from the launcher anyway.
    """
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    env["OMP_NUM_THREADS"] = "1"
    for more in extra:
        for key, value in (more or {}).items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
    return env


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_proc(cmd: list[str], *, timeout: float = 120, cwd: Path | str | None = None,
             env: dict[str, str | None] | None = None) -> Result:
    """Run cmd in its own session; on timeout kill the whole group (by id) and fail the test.
    A `meshrun` command line runs forked from this process's warm server (warm_cli.py) where its
    environment allows, else (and with MESHRUN_TEST_WARM=0) as a new process."""
    full_env = child_env(env)
    warm = _warm_server(full_env) if cmd and cmd[0] == str(BIN / "meshrun") else None
    if cmd and cmd[0] == str(BIN / "meshrun"):
        _WARM_COUNTS["warm" if warm is not None else "cold"] += 1
    if warm is not None:
        return _run_warm(warm, cmd, timeout, cwd, full_env)
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} did not finish within {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return Result(proc.returncode, out, err)


_WARM: dict[str, object] = {}
_WARM_COUNTS = {"warm": 0, "cold": 0, "restarts": 0}  # meshrun command lines run_proc ran each way (MESHRUN_SUITE_TIMES)
_WARM_LOCK = threading.Lock()


def _warm_server(env: dict[str, str]):
    """This process's warm server (started at the first call), or None where the command must start
    a new interpreter: MESHRUN_TEST_WARM=0, or an environment that could change an import's outcome."""
    if env.get("MESHRUN_TEST_WARM", "1") == "0":
        return None
    from warm_cli import import_sensitive_change

    with _WARM_LOCK:
        server = _start_warm()
        if server.proc.poll() is not None:  # it died (its stderr: warm.err in its directory): a new one
            _stop_warm()
            server = _start_warm()
        server.wait_ready()
        if import_sensitive_change(server.env, child_env(), server.imported):
            # this process's own environment moved (a test's in-process call set OMP_NUM_THREADS,
            # TORCHINDUCTOR_*, ...): a new server with it, rather than every later command cold
            _stop_warm()
            _WARM_COUNTS["restarts"] += 1
            server = _start_warm()
            server.wait_ready()
        if import_sensitive_change(server.env, env, server.imported):
            return None
    return server


def _start_warm():
    from warm_cli import WarmServer

    if "server" not in _WARM:
        workdir = Path(tempfile.mkdtemp(prefix="meshrun-warm-"))
        if not _WARM:
            atexit.register(_stop_warm)
        _WARM.update(server=WarmServer(child_env(), workdir), workdir=workdir)
        _WARM.setdefault("count", itertools.count())
    return _WARM["server"]


DESELECTED: list[str] = []  # node ids this session collected and then left out (-m, -k, --deselect)


def pytest_deselected(items) -> None:
    DESELECTED.extend(item.nodeid for item in items)


def pytest_collection_finish(session) -> None:
    """What collection built (torch, transformers, every test module: about 430,000 objects) is
    frozen: this process's collections skip it from now on (measured: each of the 3 xdist workers
    spent ~20 full collections walking it). A session that runs end-to-end or docs tests then
    starts the warm server, in the background (its imports overlap collection), so that no test's
    own clock counts its start."""
    import gc

    gc.freeze()
    if os.environ.get("MESHRUN_TEST_WARM", "1") != "0" and any(
            Path(str(item.fspath)).parent.name in ("e2e", "docs") for item in session.items):
        with _WARM_LOCK:
            _start_warm()


def _stop_warm() -> None:
    server = _WARM.pop("server", None)
    if server is not None:
        server.stop()
        shutil.rmtree(_WARM.pop("workdir"), ignore_errors=True)


def _run_warm(server, cmd: list[str], timeout: float, cwd: Path | str | None, env: dict[str, str]) -> Result:
    n = next(_WARM["count"])
    out, err = server.workdir / f"{n}.out", server.workdir / f"{n}.err"
    code, pid = server.run(list(cmd), env, str(cwd or os.getcwd()), str(out), str(err), timeout)
    if code is None:
        kill_tree(pid)
    texts = [p.read_text(encoding="utf-8", errors="replace") if p.exists() else "" for p in (out, err)]
    for p in (out, err):
        p.unlink(missing_ok=True)
    if code is None:
        pytest.fail(f"{cmd} did not finish within {timeout}s\nstdout:\n{texts[0]}\nstderr:\n{texts[1]}")
    return Result(code, *texts)


def meshrun(*args: str, **kwargs) -> Result:
    """`meshrun ARGS...` through the installed console script."""
    return run_proc([str(BIN / "meshrun"), *args], **kwargs)


_EACH = r"""
import json, os, sys, traceback
from meshrun.cli import main, quick_exit
codes = []
for argv, out, err in json.loads(sys.argv[1]):
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(out, "w") as o, open(err, "w") as e:
        os.dup2(o.fileno(), 1); os.dup2(e.fileno(), 2)
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
    codes.append(code)
print(json.dumps(codes))
quick_exit(0)  # as the console script ends: without torch's teardown (~0.5 CPU-s)
"""


def meshrun_each(*commands: list[str], timeout: float = 120, cwd: Path | str | None = None,
                 env: dict[str, str | None] | None = None) -> list[Result]:
    """Several `meshrun` command lines, one after another in ONE process (meshrun.cli.main, what the
    console script runs), each with its own stdout, stderr and exit code (an uncaught exception: its
    traceback on that stderr, exit 1, as the console script would).

    For commands that only check or read (refusals before launch, ckpt inspect/export, generate):
    the interpreter start and `import torch` (~2 CPU-s) are paid once, not once per command. Not for
    commands that launch workers: use meshrun() for those.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="meshrun-each-") as tmp:
        files = [[list(argv), f"{tmp}/{i}.out", f"{tmp}/{i}.err"] for i, argv in enumerate(commands)]
        done = run_proc([sys.executable, "-c", _EACH, json.dumps(files)], timeout=timeout, cwd=cwd, env=env)
        assert done.returncode == 0, f"meshrun_each: {done.output[-3000:]}"
        codes = json.loads(done.stdout.strip().splitlines()[-1])
        return [Result(code, Path(out).read_text(), Path(err).read_text())
                for code, (_, out, err) in zip(codes, files, strict=True)]


def train_tiny(tmp: Path, name: str, *args: str, timeout: float = 240,
               env: dict[str, str | None] | None = None) -> tuple[Result, Path]:
    """`meshrun train` on examples/configs/tiny.toml as run `name` under `tmp` (also the cwd).

    Returns the result and the run directory, `tmp / name`; the caller checks the exit code.
    """
    result = meshrun("train", TINY, "--set", f"train.name={name}", "--set", f"train.run_dir={tmp}", *args,
                     timeout=timeout, cwd=tmp, env=env)
    return result, tmp / name


def metrics_records(run_dir: Path, kind: str | None = None, *, partial: bool = False) -> list[dict]:
    """The rows of a run's metrics.jsonl, in order; only those of `kind` ("train", "eval") if given.
    `partial`: of a run still writing it (no file yet: none; a torn last line: skipped)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        if not partial:
            raise
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            if not partial:
                raise
    return [r for r in rows if kind is None or r.get("kind") == kind]


def requires(*packages: str):
    """A skip mark for tests that need optional top-level packages, found without importing them: every
    xdist worker imports every test module at collection, and transformers, pyarrow or mlflow cost
    seconds each there (a test imports what it uses in its body)."""
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}: `make setup` installs every extra")


def env_int(name: str, default: int) -> int:
    """A repetition count a test reads from the environment (CI keeps the default low; benchmarks go higher)."""
    value = os.environ.get(name, "")
    try:
        count = int(value) if value else default
    except ValueError:
        raise pytest.UsageError(f"{name} must be an integer, got {value!r}") from None
    if count < 1:
        raise pytest.UsageError(f"{name} must be >= 1, got {count}")
    return count


@pytest.fixture
def write_script(tmp_path: Path):
    """write_script("name.py", source) -> path of a script in this test's temp dir."""

    def _write(name: str, source: str) -> Path:
        path = tmp_path / name
        path.write_text(source)
        return path

    return _write


def rank_log_dir(root: Path, local_rank: int, *, error: dict | None = None, stderr: str = "") -> Path:
    """A rank's log directory as the launcher leaves it (stdout, stderr, optional error.json's meshrun block)."""
    d = root / "job_abc" / "attempt_0" / str(local_rank)
    d.mkdir(parents=True)
    (d / "stdout.log").write_text("")
    (d / "stderr.log").write_text(stderr)
    if error:
        (d / "error.json").write_text(json.dumps({"meshrun": error}))
    return d


def save_hf_tokenizer(directory: Path, texts: list[str], config: dict | None = None,
                      special_map: dict | None = None) -> Path:
    """A tiny byte-level BPE (vocab 320) trained on `texts`, saved as a Hugging Face tokenizer directory:
    tokenizer.json, plus tokenizer_config.json / special_tokens_map.json when given. No download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|endoftext|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        if content is not None:
            (directory / name).write_text(json.dumps(content))
    return directory


def save_tiny_hf(path: Path, family: str = "llama", *, seed: int = 0, **overrides) -> Path:
    """A tiny Hugging Face causal LM saved with save_pretrained into `path` (no hub): 2 layers,
    hidden 32, 4 heads, 2 kv heads, vocab 300. family 'llama', or 'qwen3' (tied embeddings,
    per-head q/k norms)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)
    if family == "qwen3":
        config = Qwen3Config(**shape, head_dim=8, tie_word_embeddings=True, **overrides)
    else:
        config = LlamaConfig(**{**shape, **overrides})
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path
