"""The `meshrun train` config: sections, TOML, --set overrides, validation messages, dump."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshrun.config import (
    SECTIONS,
    JobConfig,
    LaunchSection,
    OptimSection,
    all_keys,
    apply_overrides,
    as_dict,
    config_from_dict,
    describe,
    load_config,
    parse_override,
    save_config,
    suggest_key,
    to_toml,
)
from meshrun.errors import ConfigError, MeshrunError

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "configs"
EXAMPLES = sorted(CONFIGS.glob("*.toml"))


def error_of(fn, *args, **kwargs) -> str:
    """The ConfigError message fn raises, checked to be one line."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and msg.strip() == msg and msg
    return msg


def write(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- sections ---------------------------------------------------------------------------


def test_sections_have_a_doc_on_every_field_and_are_frozen():
    assert list(SECTIONS) == [
        "model", "data", "train", "optim", "parallel", "checkpoint", "metrics", "launch", "fault", "lora",
    ]
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            doc = f.metadata.get("doc", "")
            assert doc and "\n" not in doc, f"{cls.section}.{f.name} needs a one-line doc"
    with pytest.raises(dataclasses.FrozenInstanceError):
        JobConfig().optim.lr = 1.0  # type: ignore[misc]


def test_defaults_are_the_small_cpu_job():
    cfg = JobConfig()
    assert cfg == load_config(None) == load_config(None, [])
    assert (cfg.model.name, cfg.data.path, cfg.data.tokenizer) == ("tiny", "", "byte")
    assert (cfg.data.seq_len, cfg.train.steps, cfg.train.batch_size) == (128, 300, 16)
    assert (cfg.train.dtype, cfg.parallel.strategy, cfg.launch.nproc_per_node) == ("fp32", "ddp", "auto")
    assert 0 < cfg.optim.min_lr <= cfg.optim.lr


def test_a_section_replaced_is_validated_again():
    optim = dataclasses.replace(JobConfig().optim, lr=3e-4, min_lr=0.0)
    assert optim.lr == 3e-4
    assert "optim.lr must be > 0, got -1.0" == error_of(dataclasses.replace, optim, lr=-1.0)


def test_python_construction_checks_types_and_widens_ints():
    assert OptimSection(lr=1).lr == 1.0 and isinstance(OptimSection(lr=1).lr, float)
    assert LaunchSection(nproc_per_node=4).nproc_per_node == "4"
    assert error_of(OptimSection, lr="fast") == "optim.lr must be a number (e.g. 3e-4), got 'fast'"
    assert "train.steps must be an integer, got true" in error_of(config_from_dict, {"train": {"steps": True}})
    assert "JobConfig" not in error_of(JobConfig, optim={"lr": 1})


# --- TOML files --------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_config_loads(path):
    assert isinstance(load_config(path), JobConfig)


def test_example_configs_cover_tests_to_gpus():
    assert {"tiny.toml", "default.toml", "small.toml", "gpu-1b.toml", "gpu-8b.toml"} <= {p.name for p in EXAMPLES}
    assert load_config(CONFIGS / "default.toml") == JobConfig()
    # every key, with its doc as the comment above it: regenerate with to_toml(JobConfig(), docs=True)
    from meshrun.config.dump import HEADER, to_toml

    assert (CONFIGS / "default.toml").read_text().endswith(to_toml(JobConfig(), docs=True)[len(HEADER):]), \
        "examples/configs/default.toml is out of date: its body is to_toml(JobConfig(), docs=True) after its header"
    tiny = load_config(CONFIGS / "tiny.toml")
    assert tiny.data.seq_len == 32 and tiny.train.steps <= 30 and tiny.model.dim <= 128
    for name in ("gpu-1b.toml", "gpu-8b.toml"):
        assert load_config(CONFIGS / name).train.dtype == "bf16"


def test_toml_values_and_partial_sections(tmp_path):
    path = write(tmp_path, '[optim]\nlr = 3e-4\n[train]\nsteps = 7\nactivation_checkpointing = true\n')
    cfg = load_config(path)
    assert (cfg.optim.lr, cfg.train.steps, cfg.train.activation_checkpointing) == (3e-4, 7, True)
    assert cfg.optim.beta2 == OptimSection().beta2 and cfg.model == JobConfig().model


def test_missing_file_names_the_path(tmp_path):
    msg = error_of(load_config, tmp_path / "nope.toml")
    assert msg.startswith("config file not found: ") and "nope.toml" in msg
    assert "is a directory" in error_of(load_config, tmp_path)


def test_toml_syntax_error_has_file_and_line(tmp_path):
    path = write(tmp_path, "[train]\nsteps = 3\nlr = = 2\n")
    msg = error_of(load_config, path)
    assert msg.startswith(f"{path}:3:") and "invalid TOML" in msg
    bad = tmp_path / "bin.toml"
    bad.write_bytes(b"[train]\nname = '\xff'\n")
    assert str(bad) in error_of(load_config, bad)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[optim]\nlrr = 1e-3\n", "unknown key 'optim.lrr' in {}; did you mean 'optim.lr'?"),
        ("[train]\nlr = 1e-3\n", "unknown key 'train.lr' in {}; did you mean 'optim.lr'?"),
        ("[optm]\nlr = 1e-3\n", "unknown section [optm] in {}; did you mean [optim]?"),
        ("steps = 3\n", "unknown key 'steps' in {}; did you mean 'train.steps'?"),
        ("optim = 3\n", "'optim' is a section in {}: write [optim] and its keys below it, got optim = 3"),
        ("[train]\nsteps = '300'\n", "train.steps must be an integer, got '300' (a quoted string: write it without quotes)"),
        ("[train]\nsteps = 3.5\n", "train.steps must be an integer, got 3.5"),
        ("[train]\n[train.steps]\nx = 1\n", "train.steps must be an integer, got a table"),
        ("[train]\nshuffle = 1\n", "unknown key 'train.shuffle' in {}; did you mean 'data.shuffle'?"),
        ("[data]\nshuffle = 1\n", "data.shuffle must be true or false, got 1"),
    ],
)
def test_toml_key_and_type_errors(tmp_path, text, expected):
    path = write(tmp_path, text)
    assert error_of(load_config, path) == expected.format(path)


def test_unknown_key_without_a_close_match_lists_the_section(tmp_path):
    msg = error_of(load_config, write(tmp_path, "[metrics]\nwandb_project = 'x'\n"))
    assert msg.startswith("unknown key 'metrics.wandb_project'") and "interval, tensorboard, jsonl" in msg


# --- --set overrides -------------------------------------------------------------------


def test_overrides_parse_each_type():
    cfg = load_config(None, [
        "optim.lr=3e-4", "train.steps=12", "train.name=my run", "data.path='a b.txt'",
        "launch.nproc_per_node=4", "optim.min_lr = 0", "train.grad_clip=0",
    ])
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.train.grad_clip) == (3e-4, 0.0, 0.0)
    assert (cfg.train.steps, cfg.train.name, cfg.data.path) == (12, "my run", "a b.txt")
    assert cfg.launch.nproc_per_node == "4"


@pytest.mark.parametrize("word", ["true", "True", "YES", "on", "1"])
def test_booleans_set_true_every_way(word):
    assert load_config(None, [f"train.activation_checkpointing={word}"]).train.activation_checkpointing is True


@pytest.mark.parametrize("word", ["false", "False", "no", "OFF", "0"])
def test_booleans_set_false_every_way(word):
    assert load_config(None, [f"metrics.tensorboard={word}"]).metrics.tensorboard is False


def test_overrides_beat_the_file_and_the_last_wins(tmp_path):
    path = write(tmp_path, "[optim]\nlr = 1e-2\nmin_lr = 1e-3\n")
    cfg = load_config(path, ["optim.lr=5e-3", "optim.lr=2e-3"])
    assert (cfg.optim.lr, cfg.optim.min_lr) == (2e-3, 1e-3)
    # validation sees the final values, not each step: lr below the old min_lr is fine here
    assert load_config(path, ["optim.lr=1e-4", "optim.min_lr=0"]).optim.lr == 1e-4


def test_apply_overrides_to_a_built_config():
    cfg = apply_overrides(JobConfig(), ["train.steps=5"])
    assert cfg.train.steps == 5 and cfg.optim == JobConfig().optim
    assert parse_override("optim.eps=1e-6") == ("optim", "eps", 1e-6)


@pytest.mark.parametrize("text", ["foo", "optim.lr", "lr=3", ".lr=3", "optim.=3", "a.b.c=1", "=3"])
def test_malformed_override_shows_the_form(text):
    msg = error_of(load_config, None, [text])
    assert msg == f"--set expects section.key=value (e.g. --set optim.lr=3e-4), got {text!r}"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optim.lrr=1", "unknown key 'optim.lrr' in --set optim.lrr=1; did you mean 'optim.lr'?"),
        ("optm.lr=1", "unknown key 'optm.lr' in --set optm.lr=1; did you mean 'optim.lr'?"),
        ("train.step=3", "unknown key 'train.step' in --set train.step=3; did you mean 'train.steps'?"),
        ("optim.lr=fast", "optim.lr must be a number (e.g. 3e-4), got 'fast'"),
        ("optim.lr=nan", "optim.lr must be a finite number, got 'nan'"),
        ("train.steps=1e3", "train.steps must be an integer, got '1e3'"),
        ("train.shuffle=1", "unknown key 'train.shuffle' in --set train.shuffle=1; did you mean 'data.shuffle'?"),
        ("data.shuffle=maybe", "data.shuffle must be true or false (or yes/no, on/off, 1/0), got 'maybe'"),
    ],
)
def test_override_key_and_type_errors(override, expected):
    assert error_of(load_config, None, [override]) == expected


# --- --set takes a TOML value -------------------------------------------------------------


@pytest.mark.parametrize("override", [
    'metrics.trackers=["tensorboard","mlflow"]',      # the array the trackers error shows
    "metrics.trackers=['tensorboard', 'mlflow']",     # literal strings, spaces
    'metrics.trackers = [ "tensorboard" ,\n "mlflow" ]',  # spaces and a line break, as TOML allows
    "metrics.trackers=[tensorboard,mlflow]",          # what bash leaves of the array unquoted
    "metrics.trackers=[tensorboard, 'mlflow']",
    "metrics.trackers=tensorboard,mlflow",            # the comma form keeps working
])  # fmt: skip
def test_set_takes_a_toml_array_for_a_list_key(override):
    assert load_config(None, [override]).metrics.tracker_names == ("tensorboard", "mlflow")


def test_set_takes_an_empty_array_and_the_last_set_wins():
    cfg = load_config(None, ['metrics.trackers=["wandb"]', "metrics.trackers=[]"])
    assert cfg.metrics.tracker_names == () and cfg.metrics.trackers == ""


@pytest.mark.parametrize(("key", "value"), [
    ("optim.lr", "[1, 2]"),
    ("optim.lr", "{ a = 1 }"),
    ("train.steps", "[5]"),
    ("data.shuffle", "[true]"),
    ("train.name", '["a", "b"]'),
    ("metrics.trackers", "[1, 2]"),
    ("metrics.trackers", '[["tensorboard"]]'),
    ("metrics.trackers", '["tensorboard", "neptune"]'),
])  # fmt: skip
def test_a_wrongly_typed_set_value_fails_as_the_same_value_in_a_file(tmp_path, key, value):
    section, _, name = key.partition(".")
    in_file = error_of(load_config, write(tmp_path, f"[{section}]\n{name} = {value}\n"))
    assert error_of(load_config, None, [f"{key}={value}"]) == in_file
    assert key in in_file


@pytest.mark.parametrize(("override", "value"), [
    ("train.name=x", "x"),
    ("data.path=foo/bar", "foo/bar"),                 # not TOML: a string, as before
    ("train.name=my run", "my run"),
    ("train.name=123", "123"),                        # TOML reads a number: a string key keeps the text
    ("train.name=2024-01-01", "2024-01-01"),          # ... or a date
    ("train.name=true", "true"),
    ("train.name=[a,b]", "[a,b]"),                    # not TOML, and not a list key: the text
    ("train.name='it''s'", "it''s"),                  # not TOML: the text, outer quotes dropped
    ('train.name="caf\\u00e9"', "caf\u00e9"),          # a TOML string: escapes as in a file
])  # fmt: skip
def test_set_a_string_key(override, value):
    section, _, rest = override.partition(".")
    name = rest.partition("=")[0]
    assert getattr(getattr(load_config(None, [override]), section), name) == value


def test_set_takes_toml_integer_spellings():
    cfg = load_config(None, ["train.steps=0x10", "train.batch_size=0o10", "train.grad_accum=1_000"])
    assert (cfg.train.steps, cfg.train.batch_size, cfg.train.grad_accum) == (16, 8, 1000)
    assert load_config(None, ["optim.warmup_steps=0b11"]).optim.warmup_steps == 3


def test_a_wrongly_typed_set_value_is_one_line_and_exit_2(capsys):
    from meshrun.cli import main

    assert main(["config", "show", "--set", "optim.lr=[1, 2]"]) == 2
    err = capsys.readouterr().err
    assert err == "meshrun config: error: optim.lr must be a number (e.g. 3e-4), got an array of 2 item(s)\n"


def _set_args(text: str) -> list[str]:
    """The `--set K=V` commands a message suggests, split as a shell would split them."""
    import re
    import shlex

    found = re.findall(r"(--set (?:'[^']*'|\S+?))(?=[`\s)]|$)", text)
    assert found, text
    return [shlex.split(command)[1] for command in found]


@pytest.mark.parametrize(("flag", "value", "key", "expected"), [
    ("--steps", "20", "train.steps", 20),
    ("--lr", "3e-4", "optim.lr", 3e-4),
    ("--trackers", '["tensorboard", "mlflow"]', "metrics.trackers", "tensorboard,mlflow"),
    ("--trackers", "tensorboard,mlflow", "metrics.trackers", "tensorboard,mlflow"),
    ("--name", "my run", "train.name", "my run"),
    ("--path", "data/my tok", "data.path", "data/my tok"),
])  # fmt: skip
def test_every_set_suggestion_is_accepted_by_set(flag, value, key, expected):
    from meshrun.config import set_hint

    args = [arg for arg in _set_args(set_hint(flag, value)) if arg.startswith(f"{key}=")]
    section, _, name = key.partition(".")
    assert [getattr(getattr(load_config(None, [arg]), section), name) for arg in args] == [expected]


def test_the_trackers_error_suggests_what_set_takes():
    msg = error_of(load_config, None, ["metrics.trackers=neptune"])
    assert 'trackers = ["tensorboard", "mlflow"]' in msg  # the file's form, which --set takes too
    assert load_config(None, ['metrics.trackers=["tensorboard", "mlflow"]']).metrics.tracker_names == (
        "tensorboard", "mlflow")
    for arg in _set_args(msg):  # and the command line's own form
        assert load_config(None, [arg]).metrics.tracker_names == ("tensorboard", "mlflow")


# --- range and choice checks: each names the key, the value and what is expected ----------


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optim.lr=-0.001", "optim.lr must be > 0, got -0.001"),
        ("optim.lr=0", "optim.lr must be > 0, got 0.0"),
        ("optim.min_lr=0.5", "optim.min_lr must be <= optim.lr (0.001), got 0.5"),
        ("optim.min_lr=-1", "optim.min_lr must be >= 0, got -1.0"),
        ("optim.weight_decay=-0.1", "optim.weight_decay must be >= 0, got -0.1"),
        ("optim.beta2=1", "optim.beta2 must be in [0, 1), got 1.0"),
        ("optim.eps=0", "optim.eps must be > 0, got 0.0"),
        ("optim.warmup_steps=-5", "optim.warmup_steps must be >= 0, got -5"),
        ("optim.schedule=step", "optim.schedule must be one of 'cosine', 'constant', 'linear', 'wsd', got 'step'"),
        ("model.name=", "model.name must be a size name such as 'tiny', got ''"),
        ("model.factory=mymodel", "model.factory must be '' or 'pkg.module:function', got 'mymodel'"),
        ("model.dim=-8", "model.dim must be >= 0 (0 = the named size's), got -8"),
        ("model.dim=100", "model.dim (100) must be a multiple of model.n_heads (3)"),
        ("model.n_kv_heads=5", "model.n_heads (8) must be a multiple of model.n_kv_heads (5)"),
        ("model.max_seq_len=64", "data.seq_len (128) must be <= model.max_seq_len (64); raise model.max_seq_len or set it to 0 (the named size's)"),
        ("model.tie_embeddings=maybe", "model.tie_embeddings must be true or false (or yes/no, on/off, 1/0, or 'auto'), got 'maybe'"),
        ("data.tokenizer=", "data.tokenizer must be 'byte', a tokenizer directory or a tokenizer.json file, got ''"),
        ("data.seq_len=0", "data.seq_len must be >= 1, got 0"),
        ("data.val_fraction=0", "data.val_fraction must be > 0 and < 0.5, got 0.0"),
        ("data.val_fraction=0.5", "data.val_fraction must be > 0 and < 0.5, got 0.5"),
        ("data.num_workers=-1", "data.num_workers must be >= 0, got -1"),
        ("train.steps=0", "train.steps must be >= 1, got 0"),
        ("train.batch_size=0", "train.batch_size must be >= 1, got 0"),
        ("train.grad_accum=0", "train.grad_accum must be >= 1, got 0"),
        ("train.dtype=fp8", "train.dtype must be one of 'fp32', 'bf16', 'fp16', got 'fp8'"),
        ("train.eval_interval=-1", "train.eval_interval must be >= 0 (0 = only at the end), got -1"),
        ("train.grad_clip=-1", "train.grad_clip must be >= 0 (0 = off), got -1.0"),
        ("train.name=a/b", "train.name must be a plain name (put directories in train.run_dir), got 'a/b'"),
        ("parallel.strategy=zero", "parallel.strategy must be one of 'ddp', 'fsdp', got 'zero'"),
        ("parallel.tp=0", "parallel.tp must be an integer >= 1 or -1 (the ranks left), got 0"),
        ("parallel.tp=2", "parallel.tp must be 1 with parallel.strategy = 'ddp' (it only replicates), got 2"),
        ("parallel.pp_schedule=zb", "parallel.pp_schedule must be one of 'gpipe', '1f1b', 'interleaved_1f1b', "
         "'looped_bfs', 'interleaved_zero_bubble', got 'zb'"),
        ("parallel.reduce_dtype=auto", "parallel.reduce_dtype must be one of 'fp32', 'bf16', 'fp16', got 'auto'"),
        ("checkpoint.interval=-1", "checkpoint.interval must be >= 0 (0 = off), got -1"),
        ("checkpoint.keep=0", "checkpoint.keep must be >= 1, got 0"),
        ("checkpoint.resume=", "checkpoint.resume must be 'auto', 'never' or a checkpoint path, got ''"),
        ("metrics.interval=0", "metrics.interval must be >= 1, got 0"),
        ("metrics.charts=jpg", "metrics.charts must be one of 'auto', 'png', 'svg', got 'jpg'"),
        ("launch.nproc_per_node=0", "launch.nproc_per_node must be 'auto' or >= 1, got 0"),
        ("launch.nproc_per_node=many", "launch.nproc_per_node must be 'auto' or >= 1, got 'many'"),
        ("launch.max_restarts=-1", "launch.max_restarts must be >= 0, got -1"),
        ("launch.nnodes=2:1", "launch.nnodes must be N or MIN:MAX with 1 <= MIN <= MAX (e.g. 2 or 1:4), got '2:1'"),
        ("launch.nnodes=0", "launch.nnodes must be N or MIN:MAX with 1 <= MIN <= MAX (e.g. 2 or 1:4), got '0'"),
    ],
)
def test_range_errors_state_what_is_expected(override, expected):
    extra = {"model.dim=100": ["model.n_heads=3"], "model.n_kv_heads=5": ["model.n_heads=8"]}
    assert error_of(load_config, None, [*extra.get(override, []), override]) == expected


def test_png_charts_without_matplotlib_are_refused_before_launch(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert error_of(load_config, None, ["metrics.charts=png"]) == (
        "metrics.charts must be 'auto' or 'svg' without matplotlib (pip install 'meshrun[report]' for PNG charts), "
        "got 'png'")
    assert load_config(None, ["metrics.charts=svg"]).metrics.charts == "svg"


def test_only_one_parallel_degree_may_be_the_rest():
    msg = error_of(load_config, None, ["parallel.dp_shard=-1"])
    assert msg.startswith("only one of parallel.dp_replicate, parallel.dp_shard") and "dp_replicate, dp_shard" in msg


def test_nproc_per_node_zero_from_toml_and_int_accepted(tmp_path):
    assert error_of(load_config, write(tmp_path, "[launch]\nnproc_per_node = 0\n")) == (
        "launch.nproc_per_node must be 'auto' or >= 1, got 0"
    )
    cfg = load_config(write(tmp_path, "[launch]\nnproc_per_node = 3\nnnodes = 2\n", "ok.toml"))
    assert (cfg.launch.nproc_per_node, cfg.launch.nnodes) == ("3", "2")


def test_config_errors_are_meshrun_errors_the_cli_prints():
    with pytest.raises(MeshrunError) as info:
        load_config(None, ["optim.lr=-1"])
    assert info.value.exit_code == 2


# --- dump, save, describe --------------------------------------------------------------


def _unusual() -> JobConfig:
    return load_config(None, [
        "optim.lr=3.3e-4", "optim.min_lr=1e-7", "train.name=quote\" back\\slash tab\t é",
        "train.activation_checkpointing=on", "launch.nproc_per_node=3", "model.tie_embeddings=true", "data.val_fraction=0.1",
        "model.factory=my_pkg.models:build", "launch.nnodes=1:4",
    ])


@pytest.mark.parametrize("docs", [False, True])
def test_to_toml_round_trips(tmp_path, docs):
    for cfg in (JobConfig(), _unusual(), *(load_config(p) for p in EXAMPLES)):
        path = write(tmp_path, to_toml(cfg, docs=docs))
        assert load_config(path) == cfg


def test_save_config_writes_a_loadable_file(tmp_path):
    cfg = _unusual()
    path = save_config(cfg, tmp_path / "runs" / "r1" / "config.toml")
    assert path.exists() and load_config(path) == cfg
    assert [p.name for p in path.parent.iterdir()] == ["config.toml"]  # no temp file left


def test_describe_shows_every_key_value_default_and_doc(tmp_path):
    cfg = load_config(None, ["optim.lr=3e-3", "train.steps=50"])
    text = describe(cfg)
    for key in all_keys():
        section, name = key.split(".")
        assert f"[{section}]" in text and any(line.startswith(f"{name} ") for line in text.splitlines())
    lr_line = next(line for line in text.splitlines() if line.startswith("lr "))
    assert "0.003" in lr_line and "[default: 0.001]" in lr_line and "Peak learning rate" in lr_line
    assert "[default]" in next(line for line in text.splitlines() if line.startswith("beta1 "))
    assert load_config(write(tmp_path, text)) == cfg  # `config show > my.toml` is a valid config


def test_as_dict_is_plain_nested_values():
    d = as_dict(_unusual())
    assert list(d) == list(SECTIONS) and d["optim"]["lr"] == 3.3e-4
    assert config_from_dict(d) == _unusual()
    assert len(all_keys()) == sum(len(v) for v in d.values())


def test_docs_mention_every_key():
    text = (REPO / "docs" / "config.md").read_text()
    missing = [key for key in all_keys() if f"`{key.split('.')[1]}`" not in text]
    assert not missing, f"docs/config.md does not mention {missing}"


@pytest.mark.parametrize(
    ("key", "guess"),
    [
        ("optim.lrr", "optim.lr"),
        ("optm.lr", "optim.lr"),
        ("train.lr", "optim.lr"),
        ("steps", "train.steps"),
        ("train.learning_rate", None),
        ("metrics.zzz", None),
        ("parallel.tp_degree", None),
        ("train.batchsize", "train.batch_size"),
        ("launch.nproc", None),
        ("launch.nproc_per_nodes", "launch.nproc_per_node"),
    ],
)
def test_suggest_key(key, guess):
    assert suggest_key(key) == guess


def test_optional_bool_is_auto_none_or_explicit(tmp_path):
    assert JobConfig().model.tie_embeddings is None  # the named size decides
    assert load_config(None, ["model.tie_embeddings=yes"]).model.tie_embeddings is True
    assert load_config(None, ["model.tie_embeddings=off"]).model.tie_embeddings is False
    assert load_config(None, ["model.tie_embeddings=AUTO"]).model.tie_embeddings is None
    path = write(tmp_path, '[model]\ntie_embeddings = "auto"\n')
    assert load_config(path).model.tie_embeddings is None
    assert 'tie_embeddings = "auto"' in to_toml(JobConfig())
    assert error_of(load_config, write(tmp_path, "[model]\ntie_embeddings = 1\n", "b.toml")) == (
        "model.tie_embeddings must be true or false or 'auto', got 1"
    )


def test_config_pickles_for_worker_processes():
    import pickle

    cfg = _unusual()
    assert pickle.loads(pickle.dumps(cfg)) == cfg


# --- `meshrun config show`: the parallel degrees resolved ---------------------------------------


def _show(capsys, *overrides: str) -> str:
    from meshrun.cli import config as config_cli

    assert config_cli.main(["show", *[arg for o in overrides for arg in ("--set", o)]]) == 0
    return capsys.readouterr().out


def _value(text: str, key: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"{key} ")).split("=")[1].split("#")[0].strip()


def test_config_show_prints_degrees_resolved_for_a_fixed_world(capsys, tmp_path):
    text = _show(capsys, "parallel.strategy=fsdp", "launch.nproc_per_node=2", "launch.nnodes=2")
    assert (_value(text, "dp_replicate"), _value(text, "dp_shard")) == ("1", "4")
    assert "# [parallel] resolved for world size 4 (launch.nproc_per_node = 2 x launch.nnodes = 2)" in text
    cfg = load_config(write(tmp_path, text))  # still a config file, and it resolves the same
    assert (cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.launch.nproc_per_node) == (1, 4, "2")
    text = _show(capsys, "launch.nproc_per_node=4", "parallel.pp=2")
    assert (_value(text, "dp_replicate"), _value(text, "pp")) == ("2", "2")
    assert "pipeline gpipe, 2 stages" in text


def test_config_show_without_a_fixed_world_applies_only_the_strategy(capsys):
    text = _show(capsys, "parallel.strategy=fsdp")  # nproc_per_node 'auto': known at launch
    assert (_value(text, "dp_replicate"), _value(text, "dp_shard")) == ("1", "-1")
    assert "the world size is known only at launch (launch.nproc_per_node = 'auto'" in text
    text = _show(capsys, "launch.nproc_per_node=2", "launch.nnodes=1:2")  # elastic
    assert _value(text, "dp_replicate") == "-1"


def test_config_show_refuses_a_layout_train_would_refuse(capsys):
    from meshrun.cli import config as config_cli

    msg = error_of(config_cli.main, ["show", "--set", "parallel.strategy=fsdp", "--set", "parallel.tp=3",
                                     "--set", "launch.nproc_per_node=4"])
    assert msg.startswith("parallel.dp_shard=-1 takes the ranks left, but parallel.tp=3 = 3 does not divide "
                          "the world size 4")
    msg = error_of(config_cli.main, ["show", "--set", "parallel.pp=2", "--set", "parallel.pp_microbatches=3",
                                     "--set", "launch.nproc_per_node=2"])
    assert msg.startswith("parallel.pp_microbatches=3 does not divide train.batch_size=16")

