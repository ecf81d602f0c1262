"""How the docs test runs a page's blocks (docblocks.py finds them): a fresh directory with the
fixtures, one rule that bounds `meshrun train`, every process bounded and reaped, and a Memo that
lets a page reuse the blocks an earlier page already ran after the same blocks.

A page's blocks run as a reader runs them in one shell: what a bash or console block exports
(`source .venv/bin/activate` sets PATH and VIRTUAL_ENV) is the environment of the blocks after
it. The READMEs run as in a new shell: PATH without the virtual environment, whose `.venv` sits
in the page's directory as it does in a clone after `make run` (NEW_SHELL_PAGES)."""

from __future__ import annotations

import itertools
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from docblocks import REPO, Block, normalized, parse

from meshrun.testing.processes import kill_tree

BIN = Path(sys.executable).parent
NEW_SHELL_PAGES = ("README.md", "README.zh-CN.md")  # run with a PATH that does not hold the venv
ENV_OUT = ".doc_shell_env"  # where a shell block leaves its exported environment (NUL-separated)
BLOCK_TIMEOUT = 400  # seconds per block (~20x its time on a quiet machine): a hang fails the page, not the suite

# THE ONE RULE that makes a doc command cheaper than it reads: the default config trains 300 steps
# with 20-batch evals (minutes), so every `meshrun train` that does not name
# examples/configs/tiny.toml gets `--set train.steps=2 --set train.eval_steps=2` appended (the last
# --set wins). Runs on tiny.toml (20 steps, seconds) and every other command run exactly as
# written. meshrun itself knows nothing of this: it is a shell function that each bash/console
# block is run under.
STEPS_CAP = 2
PRELUDE = f"""set -e
meshrun() {{
  if [ "$1" = train ] && ! printf '%s\\n' "$@" | grep -qx 'examples/configs/tiny.toml'; then
    _meshrun_command "$@" --set train.steps={STEPS_CAP} --set train.eval_steps={STEPS_CAP}
  else
    _meshrun_command "$@"
  fi
}}
_meshrun_command() {{
  local script
  if [ -n "${{_meshrun_warm+x}}" ] && script=$(type -P meshrun); then
    "${{_meshrun_warm[@]}}" "$script" "$@"
  else
    command meshrun "$@"
  fi
}}
"""
# ...and the `meshrun` it runs is the one on PATH (`type -P`, as `command meshrun` finds it), started
# by tests/warm_cli.py's thin client on the shell's own descriptors: forked from the pytest
# process's warm server (its imports paid once), or, where the server refuses (an environment that
# could change an import) or is not there, exec'd as the console script. MESHRUN_TEST_WARM=0: never.
WARM_CLIENT = Path(__file__).resolve().parents[1] / "warm_cli.py"

_TRAIN_PY = """import argparse

import torch
import torch.distributed as dist

import meshrun

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=1e-3)
args = parser.parse_args()
env = meshrun.init()
x = torch.ones(1)
dist.all_reduce(x)
meshrun.print0(f"all_reduce over {env.world_size} process(es): {x.item()}, lr {args.lr}")
"""


def fixtures() -> dict[str, str]:
    """Inputs that the docs assume the reader has (their own script, package and text), written
    into each page's directory before its first block."""
    text = (REPO / "README.md").read_text(encoding="utf-8") * 4  # ~40 KB of prose: plenty of windows
    return {"train.py": _TRAIN_PY, "mypkg/__init__.py": "", "mypkg/train.py": _TRAIN_PY,
            "my_text.txt": text, "book.txt": text, "notes.txt": text[: len(text) // 4]}


@dataclass
class Outcome:
    block: Block
    ok: bool
    detail: str = ""
    seconds: float = 0.0  # wall
    reused: bool = False  # taken from an identical earlier page (Memo)
    env: dict[str, str] | None = None  # the shell's environment after the block, for the next one


def prepare_dir(workdir: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "examples").symlink_to(REPO / "examples")
    (workdir / ".venv").symlink_to(BIN.parent)  # where `make run` puts it, beside examples/
    for name, text in fixtures().items():
        (workdir / name).parent.mkdir(parents=True, exist_ok=True)
        (workdir / name).write_text(text, encoding="utf-8")


def _run(cmd: list[str], workdir: Path, env: dict[str, str]) -> tuple[int, str]:
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        return 124, f"{out}\n(killed after {BLOCK_TIMEOUT}s)"
    return proc.returncode, out


def _console_steps(text: str) -> list[tuple[str, list[str]]]:
    steps: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps and line.strip() and line.strip() != "...":
            steps[-1][1].append(line.strip())
    return steps


def _missing_lines(shown: list[str], output: str) -> list[str]:
    """The shown lines not found, in order, among the output's lines (`...` = any text)."""
    got = [" ".join(ln.split()) for ln in output.splitlines()]  # runs of blanks compare equal
    pos = 0
    for want in shown:
        pattern = re.compile(".*".join(re.escape(part) for part in " ".join(want.split()).split("...")))
        hit = next((k for k in range(pos, len(got)) if pattern.fullmatch(got[k])), None)
        if hit is None:
            return shown[shown.index(want):]
        pos = hit + 1
    return []


def new_shell_env(env: dict[str, str]) -> dict[str, str]:
    """`env` as a new login shell has it: no virtual environment on PATH, none active."""
    venv = BIN.resolve()
    path = [p for p in env.get("PATH", "").split(":") if p and Path(p).resolve() != venv]
    return {**{k: v for k, v in env.items() if k != "VIRTUAL_ENV"}, "PATH": ":".join(path)}


def _warm_prelude(env: dict[str, str]) -> str:
    """The shell variable (not exported: the commands' environment stays the block's) that sends
    `meshrun` through the warm server, or nothing when there is none for `env`."""
    try:
        from conftest import _warm_server
    except ImportError:  # not under pytest
        return ""
    server = _warm_server(env)
    if server is None:
        return ""
    words = [sys.executable, "-I", "-S", str(WARM_CLIENT), "client", server.path]
    return f"_meshrun_warm=({' '.join(shlex.quote(w) for w in words)})\n"


def _shell_script(text: str, env: dict[str, str]) -> str:
    """A bash block or command, then its exported environment for the next block (one shell)."""
    return f'{_warm_prelude(env)}{PRELUDE}{text}\nenv -0 > "$PWD/{ENV_OUT}"\n'


def _exported(workdir: Path, env: dict[str, str]) -> dict[str, str]:
    path = workdir / ENV_OUT
    if not path.is_file():
        return env
    pairs = (item.partition("=") for item in path.read_text(encoding="utf-8").split("\0") if "=" in item)
    path.unlink()
    return {k: v for k, _, v in pairs if k not in ("PWD", "OLDPWD", "SHLVL", "_")}


def run_block(block: Block, workdir: Path, env: dict[str, str]) -> Outcome:
    """Run one block in `workdir`; its Outcome, and `env` as the block leaves it (shell blocks)."""
    name = f"doc_block_{block.line}"
    if block.lang == "python":
        script = workdir / f"{name}.py"
        script.write_text(block.text, encoding="utf-8")
        python = shutil.which("python3", path=env.get("PATH")) if env.get("VIRTUAL_ENV") else None
        rc, out = _run([python or sys.executable, script.name], workdir, env)
        return Outcome(block, rc == 0, f"exit {rc}\n\n{out}", env=env)
    if block.lang == "bash":
        script = workdir / f"{name}.sh"
        script.write_text(_shell_script(block.text, env), encoding="utf-8")
        rc, out = _run(["bash", script.name], workdir, env)
        return Outcome(block, rc == 0, f"exit {rc}\n\n{out}", env=_exported(workdir, env))
    steps = _console_steps(block.text)
    if not steps:
        return Outcome(block, False, "a console block needs at least one `$ ` command line")
    for k, (command, shown) in enumerate(steps):
        script = workdir / f"{name}_{k}.sh"
        script.write_text(_shell_script(command, env), encoding="utf-8")
        rc, out = _run(["bash", script.name], workdir, env)
        env = _exported(workdir, env)
        if (rc == 0) == (block.marker == "fails"):
            expected = "a non-zero exit (marked `doc-test: fails`)" if block.marker == "fails" else "exit 0"
            return Outcome(block, False, f"$ {command}\nexpected {expected}, got exit {rc}\n\n{out}")
        missing = _missing_lines(shown, out)
        if missing:
            return Outcome(block, False, f"$ {command}\nexit {rc}; the output lacks the shown line {missing[0]!r}\n\n{out}")
    return Outcome(block, True, env=env)


class Memo:
    """Blocks already run, by their page's runnable blocks up to and including them (up to comments),
    with a copy of the page directory after each: a page that starts like another (the two READMEs,
    docs that begin from the same run) takes those blocks' outcomes and files instead of running them.
    Every page starts from the same fixtures, so the same blocks leave the same files."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.done: dict[tuple, tuple[Outcome, Path]] = {}
        self._names = itertools.count()  # unique snapshot names across threads

    def reuse(self, key: tuple, block: Block, workdir: Path) -> Outcome | None:
        if key not in self.done:
            return None
        outcome, snapshot = self.done[key]
        shutil.rmtree(workdir)
        shutil.copytree(snapshot, workdir, symlinks=True)
        return Outcome(block, outcome.ok, outcome.detail, reused=True, env=outcome.env)

    def keep(self, key: tuple, outcome: Outcome, workdir: Path) -> None:
        snapshot = self.store / f"snapshot-{next(self._names)}"
        shutil.copytree(workdir, snapshot, symlinks=True)
        self.done[key] = (outcome, snapshot)


def run_page(path: Path, workdir: Path, env: dict[str, str], memo: Memo | None = None) -> list[Outcome]:
    """Run the page's runnable blocks in order in the fresh `workdir`; stop at the first failure
    (later blocks usually depend on it)."""
    prepare_dir(workdir)
    new_shell = path.name in NEW_SHELL_PAGES
    env = new_shell_env(env) if new_shell else {**env, "PATH": f"{BIN}:{env.get('PATH', '')}"}
    outcomes: list[Outcome] = []
    key: tuple = (("new shell", new_shell),)
    for block in parse(path):
        if not block.runs:
            continue
        key += ((block.lang, block.marker, normalized(block)),)
        outcome = memo.reuse(key, block, workdir) if memo else None
        if outcome is None:
            start = time.monotonic()
            outcome = run_block(block, workdir, env)
            outcome.seconds = time.monotonic() - start
            if memo and outcome.ok:
                memo.keep(key, outcome, workdir)
        env = outcome.env or env
        outcomes.append(outcome)
        if not outcome.ok:
            break
    return outcomes


def _first_key(page: Path) -> tuple:
    first = next(((b.lang, b.marker, normalized(b)) for b in parse(page) if b.runs), ("nothing to run", str(page)))
    return (page.name in NEW_SHELL_PAGES, first)


def run_pages(pages: list[Path], root: Path, env: dict[str, str], memo: Memo, workers: int = 2) -> dict[Path, list[Outcome]]:
    """run_page for each page, `workers` at a time. Pages whose first blocks are the same run one
    after the other, in the given order, so the later ones reuse the earlier ones' blocks (Memo);
    each page still runs alone in its own directory, in document order. Two at a time, because a
    page spends much of its time in one process (start-up, a CLI, a report) while the other core idles."""
    groups: dict[tuple, list[Path]] = {}
    for page in pages:
        groups.setdefault(_first_key(page), []).append(page)
    results: dict[Path, list[Outcome]] = {}

    def run_group(group: list[Path]) -> None:
        for page in group:
            results[page] = run_page(page, root / f"page-{pages.index(page)}-{page.stem}", env, memo)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for future in [pool.submit(run_group, group) for group in groups.values()]:
            future.result()
    return results


def failure_report(outcomes: list[Outcome], tail: int = 3000) -> str:
    """Each failed block: where, what was expected (the detail's first lines), and its output's end."""
    parts = []
    for o in outcomes:
        if not o.ok:
            head, _, output = o.detail.partition("\n\n")
            parts.append(f"{o.block.where} ({o.block.lang}) failed: {head}\n{output[-tail:]}")
    return "\n\n".join(parts)
