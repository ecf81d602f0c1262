"""The code's shape, checked: importing meshrun changes nothing, no import cycle, small modules.

These read the source (ast) or run a fresh interpreter; none needs a process group.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "meshrun"
MAX_LINES = 300
# Being split in parallel branches: reported (xfail) instead of failing until those are merged;
# empty now: the test is strict.
PENDING_SPLITS: dict[str, int] = {}

# What `import meshrun` might touch: compared before and after the import in a fresh interpreter.
_PROBE = r"""
import json, signal, sys, threading
import torch, torch.distributed as dist, torch.distributed.distributed_c10d as c10d
import torch.optim.optimizer as opt

COLLECTIVES = ["all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather",
               "scatter", "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list"]

def snapshot():
    return {
        "excepthook": id(sys.excepthook),
        "signals": {s.name: repr(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)},
        "dist": {op: id(getattr(dist, op)) for op in COLLECTIVES},
        "c10d": {op: id(getattr(c10d, op)) for op in COLLECTIVES},
        "optimizer_hooks": [len(opt._global_optimizer_pre_hooks), len(opt._global_optimizer_post_hooks)],
        "meta_path": [type(f).__name__ for f in sys.meta_path],
        "threads": sorted(t.name for t in threading.enumerate()),
    }

before = snapshot()
import meshrun
for name in meshrun.__all__:  # the lazy attributes too: resolving them imports their modules
    getattr(meshrun, name)
if sys.argv[1] == "every-module":
    import importlib, pkgutil
    for info in pkgutil.walk_packages(meshrun.__path__, "meshrun."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
after = snapshot()
print(json.dumps({"before": before, "after": after}))
"""


@pytest.mark.parametrize("case", ["plain-python", "debug-worker", "every-module"])
def test_import_meshrun_changes_no_hook_signal_collective_or_thread(case):
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}  # no RANK/WORLD_SIZE: as under plain python
    if case != "plain-python":  # a `meshrun launch --debug collectives` worker's env: still nothing until init()
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                   TORCHELASTIC_RUN_ID="probe", MESHRUN_DEBUG="collectives", MESHRUN_HANG_TIMEOUT="60")
    done = subprocess.run([sys.executable, "-c", _PROBE, case], capture_output=True, text=True, timeout=180,
                          env=env)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    changed = {key: (seen["before"][key], seen["after"][key])
               for key in seen["before"] if seen["before"][key] != seen["after"][key]}
    assert not changed, f"`import meshrun` changed process state: {changed}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: not inside functions, not under `if TYPE_CHECKING`."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                test = node.test
                name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
                if name != "TYPE_CHECKING":
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, (ast.With, ast.For, ast.While)):
                visit(node.body)

    visit(tree.body)
    return found


def import_graph() -> dict[str, set[str]]:
    """meshrun module -> the meshrun modules its import runs (a submodule also runs its parents)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _module_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
        deps: set[str] = set()
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # `import a.b.c` runs a, a.b and a.b.c
                module = ".".join(parts[:i])
                # a module's own parent packages are already running when it is imported
                if module in files and module != name and not name.startswith(module + "."):
                    deps.add(module)
        graph[name] = deps
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as one cycle's members."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            members = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                members.append(top)
                if top == node:
                    break
            if len(members) > 1:
                cycles.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_meshrun_modules():
    graph = import_graph()
    assert len(graph) > 50 and "meshrun.runtime.session" in graph  # the walk found the package
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (module-level imports): " + "; ".join(" <-> ".join(c) for c in cycles)


def test_checkpoint_imports_neither_the_training_loop_nor_the_models():
    """checkpoint sits below train and models on the data path: none of its imports, even lazy ones, go up."""
    upward = ("meshrun.train", "meshrun.models")
    found = {}
    for path in (PACKAGE / "checkpoint").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found.update({f"{path.name}:{node.lineno}": n for n in names if n.startswith(upward)})
    assert not found, f"checkpoint imports up the data path: {found}"


def test_no_module_over_300_lines():
    sizes = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    over = {path: n for path, n in sizes.items() if n > MAX_LINES}
    unexpected = {path: n for path, n in over.items() if path not in PENDING_SPLITS}
    assert not unexpected, f"modules over {MAX_LINES} lines (split them by responsibility): {unexpected}"
    pending = {path: n for path, n in over.items() if path in PENDING_SPLITS}
    if pending:  # being split in another branch; empty PENDING_SPLITS once it is merged
        pytest.xfail(f"still over {MAX_LINES} lines until merged: {pending}")
