"""Fuzz every config key and every launch flag through `meshrun train`'s checks, in process.

Each case is a `meshrun train` command line: 1-3 config keys set to hostile or mistaken values
(through --set, or a TOML file), plus 0-2 launch flags. `check_train_args` (what `meshrun train`
runs before torch), then the launch plan and the preflight (with torch), must either accept it or raise one MeshrunError line that names a key or
flag of the case, and must create no file or directory. Any other exception is a traceback a
user would have seen. The example count is bounded (MESHRUN_FUZZ_EXAMPLES, default 200) so this
stays a few seconds; run with `-s` for the figures (cases tried, tracebacks).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from conftest import env_int
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from meshrun.cli.train import check_train_args
from meshrun.config import SECTIONS, all_keys
from meshrun.config.base import field_types, unwrap
from meshrun.config.dump import toml_value
from meshrun.errors import MeshrunError
from meshrun.launch.args import build_parser as build_launch_parser
from meshrun.launch.spec import checked_options, launch_spec
from meshrun.train.preflight import check_with_torch

EXAMPLES = env_int("MESHRUN_FUZZ_EXAMPLES", 200)
# No shrinking: a failing case is reported as found. Shrinking re-runs the test on ever smaller cases
# with no bound of its own, and pytest-timeout's one alarm does not stop it (a case whose check
# looped over 10**18 layers kept one xdist worker busy until the suite's outer timeout).
PHASES = [phase for phase in Phase if phase not in (Phase.shrink, Phase.explain)]
NOT_FOR_TRAIN = {"-h", "--help", "-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path"}

INTS = [0, 1, -1, 2, 3, 4, 8, 64, 4096, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30, 10**9]
FLOATS = [0.0, -0.0, 1e-3, 0.5, 0.999, 1.0, 2.0, -1.0, 1e308, float("inf"), float("-inf"), float("nan")]
STRINGS = ["", "auto", "x" * 300, "a/b", "..", ".", "a\x00b", "os:system", "builtins:eval", "json:loads",
           "no_such_module_xyz:build", "tiny", "8b", "huge", "runs", "/etc/passwd", "/proc/x", "fp32",
           "bf16", "cosine", "gpipe", "1f1b", "ddp", "fsdp", "1:4", "0", "2", "c10d", "static", "foo",
           "HOST:29400", ":99999", ":", "host:abc", "127.0.0.1:0", "never", "byte", "x.json", " ", "é"]
TEXTS = ["0", "1", "-1", "2", "1e9", "99999999999999999999", "abc", "", "nan", "inf", "1e308", "0x10",
         " 5 ", "1_000", "true", "maybe", "auto", "'quoted'", "x" * 300, "/etc/passwd", "os:system", ":",
         '["tensorboard", "mlflow"]', "[a, b]", "[1, [2]]", "{a = 1}", "0x10", "[" * 3000]
FLAG_VALUES = ["0", "1", "2", "-1", "99999", "65535", "abc", "inf", "nan", "1e308", "", "HOST:29400",
               ":99999", ":", "host:abc", "127.0.0.1:0", "localhost:29400", "c10d", "static", "foo",
               "etcd", "/etc/passwd", "SIGFOO", "SIGTERM,SIGUSR1", "3", "0:3,1:2", "a=b", "x",
               "join_timeout=nan", "join_timeout=5", "auto", "1:2", "2:1", "x" * 300, "spawn", "null"]
DEEP = "[model]\nname = " + "[" * 3000 + "]" * 3000 + "\n"


def _launch_flags() -> dict[str, bool]:
    """Every launch flag `meshrun train` accepts -> whether it takes a value."""
    flags = {}
    for action in build_launch_parser()._actions:
        for flag in action.option_strings:
            if flag not in NOT_FOR_TRAIN:
                flags[flag] = action.nargs != 0
    return flags


LAUNCH_FLAGS = _launch_flags()
KEYS = all_keys()
TYPES = {f"{s}.{name}": hint for s, cls in SECTIONS.items() for name, hint in field_types(cls).items()}


def _toml_values(key: str):
    typ, _ = unwrap(TYPES[key])
    pool = {int: INTS, float: FLOATS, str: STRINGS, bool: [True, False]}[typ]
    return st.one_of(st.sampled_from(pool), st.sampled_from(INTS + FLOATS + STRINGS[:6] + [True, [1, [2]]]))


@st.composite
def cases(draw):
    keys = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
    mode = draw(st.sampled_from(["set", "toml", "deep"]))
    values = {key: draw(st.sampled_from(TEXTS) if mode == "set" else _toml_values(key)) for key in keys}
    flags = draw(st.lists(st.sampled_from(sorted(LAUNCH_FLAGS)), max_size=2, unique=True))
    flag_values = {flag: draw(st.sampled_from(FLAG_VALUES)) for flag in flags if LAUNCH_FLAGS[flag]}
    return mode, values, flags, flag_values


def _toml(values: dict) -> str:
    tables: dict[str, list[str]] = {}
    for key, value in values.items():
        section, _, name = key.partition(".")
        if isinstance(value, list):
            text = "[1, [2]]"
        else:
            text = toml_value(value) if not (isinstance(value, float) and value != value) else "nan"
            text = {"inf": "inf", "-inf": "-inf"}.get(repr(value), text)
        tables.setdefault(section, []).append(f"{name} = {text}")
    return "".join(f"[{s}]\n" + "\n".join(rows) + "\n" for s, rows in tables.items())


def _argv(case, where: Path) -> tuple[list[str], set[str]]:
    mode, values, flags, flag_values = case
    argv: list[str] = []
    names = {k.partition(".")[2] for k in values} | set(values)
    if mode == "set":
        for key, text in values.items():
            argv += ["--set", f"{key}={text}"]
    else:
        config = where / "fuzz.toml"
        config.write_text(DEEP if mode == "deep" else _toml(values), encoding="utf-8")
        argv.append(str(config))
        names |= {str(config), "fuzz.toml"}
    for flag in flags:
        argv += [flag, flag_values[flag]] if LAUNCH_FLAGS[flag] else [flag]
        names |= {flag, flag.lstrip("-"), flag.replace("_", "-"), flag.replace("-", "_")}
    names |= {"launch.", "--nproc-per-node", "--nnodes", "--rdzv", "--master", "--log-dir", "model.",
              "train.", "data.", "parallel.", "optim.", "checkpoint.", "metrics."} & _named_by_flags(flags)
    return argv, names


def _named_by_flags(flags: list[str]) -> set[str]:
    # a flag that another flag's check reports (e.g. --node-rank's range names --nnodes)
    return {"--nnodes", "--rdzv", "--master", "launch."} if flags else set()


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def fuzz_dir(tmp_path, monkeypatch):
    for key in [k for k in os.environ if k.startswith(("SLURM_", "PET_", "MESHRUN_"))]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a directory")
    return tmp_path


@settings(phases=PHASES, max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=cases())
def test_every_key_and_flag_is_accepted_or_refused_in_one_line(fuzz_dir, case):
    argv, names = _argv(case, fuzz_dir)
    before = _tree(fuzz_dir)
    try:
        _, cfg, launch_args, options = check_train_args(argv)
        # what `meshrun train` checks next, with torch, still before any directory or worker
        plan = launch_spec(launch_args, checked=options)
        check_with_torch(cfg, nproc_per_node=plan.nproc_per_node, nnodes=plan.nnodes)
        outcome = "accepted"
    except MeshrunError as exc:
        message = str(exc)
        assert "\n" not in message and message.strip(), (argv, message)
        assert any(name in message for name in names), f"{argv}: {message!r} names none of {sorted(names)}"
        assert exc.exit_code == 2
        outcome = "refused"
    except Exception as exc:  # a traceback the user would have seen
        _FIGURES["tracebacks"] += 1
        raise AssertionError(f"traceback for {argv}: {type(exc).__name__}: {exc}") from exc
    finally:
        _FIGURES["cases"] += 1
    _FIGURES[outcome] += 1
    assert _tree(fuzz_dir) - before <= {"fuzz.toml"}, f"{argv} created {_tree(fuzz_dir) - before}"


_FIGURES = {"cases": 0, "accepted": 0, "refused": 0, "tracebacks": 0}


def test_fuzz_figures(capsys):
    """Prints the figures of the fuzz run above (pytest -s); it must have run and found no traceback."""
    if _FIGURES["cases"] == 0:
        pytest.skip("the fuzz test did not run in this session")
    with capsys.disabled():
        print(f"\nconfig/flag fuzz: {_FIGURES['cases']} cases, {_FIGURES['refused']} refused in one line, "
              f"{_FIGURES['accepted']} accepted, {_FIGURES['tracebacks']} tracebacks")
    assert _FIGURES["tracebacks"] == 0 and _FIGURES["refused"] > 0


@settings(phases=PHASES, max_examples=max(EXAMPLES // 5, 20), deadline=None, database=None)
@given(flags=st.lists(st.sampled_from(sorted(LAUNCH_FLAGS) + ["-m", "--no-python", "--run-path"]),
                      max_size=3, unique=True),
       values=st.lists(st.sampled_from(FLAG_VALUES), min_size=3, max_size=3))
def test_meshrun_launch_flags_are_checked_in_one_line(flags, values):
    argv: list[str] = []
    for flag, value in zip(flags, values, strict=False):
        argv += [flag, value] if LAUNCH_FLAGS.get(flag, False) else [flag]
    try:
        checked_options(build_launch_parser().parse_args([*argv, "train.py"]), environ={})
    except MeshrunError as exc:
        assert "\n" not in str(exc), (argv, str(exc))


def test_a_deeply_nested_toml_is_one_line(fuzz_dir):
    (fuzz_dir / "deep.toml").write_text(DEEP)
    with pytest.raises(MeshrunError, match="nested too deeply"):
        check_train_args([str(fuzz_dir / "deep.toml")])


@pytest.mark.parametrize(("argv", "named"), [
    (["--steps", "20"], "`--set train.steps=20`"),
    (["--steps=20"], "`--set train.steps=20`"),
    (["--lr", "3e-4"], "`--set optim.lr=3e-4`"),
    (["--tp", "2"], "`--set parallel.tp=2`"),
    (["--batch-size=8"], "`--set train.batch_size=8`"),
    (["--train.steps", "5"], "`--set train.steps=5`"),
    (["--steps"], "`--set train.steps=VALUE`"),
])
def test_a_flag_that_names_a_config_key_suggests_set(fuzz_dir, argv, named):
    with pytest.raises(MeshrunError, match="did you mean") as info:
        check_train_args(argv)
    assert named in str(info.value) and info.value.exit_code == 2


def test_model_size_beyond_this_machine_names_the_planner_estimate(fuzz_dir):
    with pytest.raises(MeshrunError, match=r"model\.dim=1000000000, .*: training needs .* GiB") as info:
        check_train_args(["--set", "model.dim=1000000000", "--nproc-per-node", "2"])
    assert "more than its" in str(info.value)
    _, cfg, _, _ = check_train_args(["--nproc-per-node", "2"])  # the default fits
    assert dataclasses.asdict(cfg)["model"]["name"] == "tiny"


@pytest.mark.parametrize("value", ["nan", "inf", "1e308"])
def test_a_hang_timeout_from_the_environment_is_checked_too(fuzz_dir, monkeypatch, value):
    monkeypatch.setenv("MESHRUN_HANG_TIMEOUT", value)
    with pytest.raises(MeshrunError, match=r"\$MESHRUN_HANG_TIMEOUT .*finite"):
        check_train_args([])


@pytest.mark.parametrize(("source", "expected"), [
    ("def build():\n    return 42\n", "returned int, not a torch.nn.Module"),
    ("def build(model_cfg, vocab_size):\n    raise RuntimeError('boom')\n", r"failed to build the model \(RuntimeError: boom\)"),
])
def test_a_factory_must_build_an_nn_module_before_workers_start(fuzz_dir, monkeypatch, source, expected):
    module = f"fuzzmodels_{abs(hash(source))}"  # a fresh module per case (sys.modules caches imports)
    (fuzz_dir / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(fuzz_dir))
    _, cfg, launch_args, options = check_train_args(["--set", f"model.factory={module}:build"])
    plan = launch_spec(launch_args, checked=options)
    with pytest.raises(MeshrunError, match=expected):
        check_with_torch(cfg, nproc_per_node=plan.nproc_per_node, nnodes=plan.nnodes)
