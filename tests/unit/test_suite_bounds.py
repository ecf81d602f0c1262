"""No test can time out by design: every bound a test puts on its own work is below pytest's bound for it.

pytest-timeout stops a test after `timeout` (pyproject.toml), or after a module's `pytestmark` or a
test's own `pytest.mark.timeout(N)`. A test that waits on a process, a launch or a rank for longer
than that would be killed by pytest first, with no word of what it waited for. So every `timeout=`
a test, a fixture or a test helper passes (a literal, a module constant, or the default of the
suite's helpers: run_proc, meshrun, train_tiny, run_distributed) must be under the bound of the
tests that run it. Read from the test files' source (ast); nothing runs. Helper modules such as
docs/docrun.py are bounded by the marks of the tests that call them.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"


def default_bound() -> float:
    with open(REPO / "pyproject.toml", "rb") as fp:
        return float(tomllib.load(fp)["tool"]["pytest"]["ini_options"]["timeout"])


def _helper_defaults() -> dict[str, float]:
    """The `timeout` default of each helper the tests call without one."""
    import conftest

    from meshrun.testing import run_distributed

    found = {}
    for fn in (conftest.run_proc, conftest.meshrun, conftest.train_tiny, run_distributed):
        param = inspect.signature(fn).parameters.get("timeout")
        if param is not None and isinstance(param.default, (int, float)):
            found[fn.__name__] = float(param.default)
    found["meshrun"] = found["run_proc"]  # meshrun(...) is run_proc(...) with its **kwargs
    return found


def _number(node: ast.expr | None, names: dict[str, float]) -> float | None:
    """A constant number: a literal, a module-level name bound to one, or arithmetic of those."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult, ast.Sub)):
        left, right = _number(node.left, names), _number(node.right, names)
        if left is None or right is None:
            return None
        return {ast.Add: left + right, ast.Mult: left * right, ast.Sub: left - right}[type(node.op)]
    return None


def _mark_timeout(node: ast.expr, names: dict[str, float]) -> float | None:
    """N of `pytest.mark.timeout(N)` (also inside a list of marks)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        values = [_mark_timeout(item, names) for item in node.elts]
        return next((v for v in values if v is not None), None)
    if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "timeout" and node.args:
        return _number(node.args[0], names)
    return None


def _callee(call: ast.Call) -> str | None:
    return getattr(call.func, "id", None) or getattr(call.func, "attr", None)


def bound_violations(path: Path, default: float, helpers: dict[str, float]) -> list[str]:
    """Every timeout in `path` at or above the pytest bound of the function it is in."""
    tree = ast.parse(path.read_text(), str(path))
    names: dict[str, float] = {}
    module_bound = default
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
            if target == "pytestmark":
                module_bound = _mark_timeout(node.value, names) or module_bound
            else:
                value = _number(node.value, names)
                if value is not None:
                    names[target] = value
    found = []
    for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        own = [b for b in (_mark_timeout(d, names) for d in func.decorator_list) if b is not None]
        bound = own[0] if own else module_bound
        for call in [n for n in ast.walk(func) if isinstance(n, ast.Call)]:
            given = next((k.value for k in call.keywords if k.arg == "timeout"), None)
            seconds = _number(given, names) if given is not None else helpers.get(_callee(call) or "")
            if given is None and any(k.arg is None for k in call.keywords):
                continue  # **kwargs may carry it: not decidable here
            if seconds is not None and seconds >= bound:
                where = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
                found.append(f"{where}:{call.lineno} in {func.name}: {_callee(call)}(timeout={seconds:g}) "
                             f">= pytest's {bound:g} s for it")
    return found


def test_no_test_waits_longer_than_pytest_lets_it():
    default, helpers = default_bound(), _helper_defaults()
    assert {"run_proc", "train_tiny", "run_distributed"} <= set(helpers)
    found = [v for path in sorted(TESTS.rglob("test_*.py")) for v in bound_violations(path, default, helpers)]
    assert not found, "bounds that pytest-timeout would cut first (raise the test's mark or lower the bound):\n" + \
        "\n".join(found)


def test_the_bound_check_finds_a_wait_longer_than_its_test(tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "import pytest\nLONG = 200\n"
        "def test_a():\n    run_proc(['x'], timeout=LONG * 2)\n"
        "@pytest.mark.timeout(900)\ndef test_b():\n    run_proc(['x'], timeout=LONG * 2)\n"
        "@pytest.mark.timeout(60)\ndef test_c():\n    train_tiny(tmp, 'n')\n")
    found = bound_violations(sample, 300.0, {"run_proc": 120.0, "train_tiny": 240.0})
    assert [f.split(" in ")[1].split(":")[0] for f in found] == ["test_a", "test_c"], found
