"""The code's shape, checked: importing meshrun changes nothing, imports go down docs/architecture.md's
order (lazy ones included) with no cycle, benchmarks share one helper module, no oversized module.

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
MAX_LINES = 450  # a backstop, not the rule: docs/architecture.md

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


def _module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, package: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in the file: at the top, inside functions (lazy), under
    `if TYPE_CHECKING:`, and `importlib.import_module("...")` with a literal name. `from a import b`
    yields both a and a.b (b may be a submodule)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def import_edges(src: Path = SRC) -> dict[str, dict[str, int]]:
    """meshrun module -> {meshrun module it imports: first line}, every import counted (see _imports).
    A module's own parent packages are left out: they are running when it is imported."""
    files = {_module_name(p, src): p for p in (src / "meshrun").rglob("*.py")}
    edges: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: dict[str, int] = {}
        for line, target in _imports(ast.parse(path.read_text(), str(path)), package):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # `import a.b.c` runs a, a.b and a.b.c
                module = ".".join(parts[:i])
                if module in files and module != name and not name.startswith(module + "."):
                    deps.setdefault(module, line)
        edges[name] = deps
    return edges


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """meshrun module -> the meshrun modules it imports, lazily or not."""
    return {name: set(deps) for name, deps in import_edges(src).items()}


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
    assert not cycles, "import cycles (lazy imports included): " + "; ".join(" <-> ".join(c) for c in cycles)


ARCHITECTURE = SRC.parent / "docs" / "architecture.md"


def layers(page: Path = ARCHITECTURE) -> list[list[str]]:
    """The ```layers block of docs/architecture.md: one layer a line, top first, siblings by comma."""
    text = page.read_text(encoding="utf-8")
    block = text.split("```layers\n", 1)[1].split("```", 1)[0]
    return [[name.strip() for name in line.split(",")] for line in block.splitlines() if line.strip()]


def unit_of(module: str) -> str:
    """The package (or top-level module) a module belongs to: meshrun.a.b -> a; the root -> meshrun."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "meshrun"


def upward_imports(edges: dict[str, dict[str, int]], order: list[list[str]]) -> list[str]:
    """Every import of a module in one unit from another unit that is not strictly below it."""
    level = {name: depth for depth, layer in enumerate(reversed(order)) for name in layer}
    found = []
    for module, deps in sorted(edges.items()):
        for target, line in sorted(deps.items()):
            a, b = unit_of(module), unit_of(target)
            if a != b and level[b] >= level[a]:
                how = "sideways to a sibling" if level[b] == level[a] else "up"
                found.append(f"{module}:{line} imports {target} ({how}: {a} -> {b})")
    return found


def test_the_layer_order_names_every_package_once():
    order = layers()
    named = [name for layer in order for name in layer]
    assert len(named) == len(set(named)), f"named twice in docs/architecture.md: {named}"
    units = {unit_of(m) for m in import_graph()}
    assert not units - set(named), f"packages docs/architecture.md does not place: {sorted(units - set(named))}"
    assert not set(named) - units, f"docs/architecture.md names what src/ lacks: {sorted(set(named) - units)}"


def test_every_import_goes_down_the_layers_lazy_ones_included():
    found = upward_imports(import_edges(), layers())
    assert not found, "imports against docs/architecture.md's order:\n" + "\n".join(found)


def test_the_layer_check_sees_a_lazy_import_inside_a_function(tmp_path):
    """A copy of src/ with one lazy import added against the order (checkpoint -> train, inside a
    function): the check finds it, with its line."""
    import shutil

    copy = tmp_path / "src"
    shutil.copytree(SRC / "meshrun", copy / "meshrun", ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "meshrun" / "checkpoint" / "manifest.py"
    target.write_text(target.read_text() + "\n\ndef _scratch():\n    from meshrun.train.trainer import train\n    return train\n")
    found = upward_imports(import_edges(copy), layers())
    assert [f for f in found if f.startswith("meshrun.checkpoint.manifest:")] == [
        f"meshrun.checkpoint.manifest:{len(target.read_text().splitlines()) - 1} imports meshrun.train "
        "(up: checkpoint -> train)",
        f"meshrun.checkpoint.manifest:{len(target.read_text().splitlines()) - 1} imports meshrun.train.trainer "
        "(up: checkpoint -> train)"]
    target.write_text(target.read_text() + "\n\nif False:\n    import importlib\n"
                      "    importlib.import_module('meshrun.cli.train')\n")
    assert any("meshrun.cli.train" in f for f in upward_imports(import_edges(copy), layers()))


BENCHMARKS = SRC.parent / "benchmarks"


def test_benchmarks_share_helpers_through_common_only():
    """A benchmark script imports no other script; the shared helpers are benchmarks/common.py's,
    and common.py imports no script: no circle, one place."""
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")}
    assert "common" in scripts
    found = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        for line, target in _imports(ast.parse(path.read_text(), str(path)), ""):
            local = target.split(".")[0]
            if local in scripts and not (local == "common" and path.stem != "common"):
                found.append(f"benchmarks/{path.name}:{line} imports {target}")
    assert not found, "benchmarks importing each other (use benchmarks/common.py):\n" + "\n".join(found)


def test_no_module_over_the_ceiling():
    """docs/architecture.md: one responsibility per module; the line count is only a backstop."""
    sizes = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    over = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (does each hold one job?): {over}"


def test_every_hugging_face_load_refuses_remote_code():
    """No code from data: every `from_pretrained` in src/ passes trust_remote_code=False, so a
    directory's own modelling code never runs, and transformers never asks on stdout."""
    import ast

    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "from_pretrained":
                refused = any(k.arg == "trust_remote_code" and isinstance(k.value, ast.Constant)
                              and k.value.value is False for k in node.keywords)
                if not refused:
                    found.append(f"{path.relative_to(SRC.parent)}:{node.lineno}")
    assert not found, f"from_pretrained without trust_remote_code=False: {found}"
