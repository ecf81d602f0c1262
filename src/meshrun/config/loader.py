"""Load a JobConfig: TOML file, then `--set section.key=value` overrides, then validation.

    cfg = load_config("examples/configs/tiny.toml", ["optim.lr=3e-4", "train.dtype=bf16"])
    load_config(None, ['metrics.trackers=["tensorboard", "mlflow"]'])   # a TOML value, lists included

A `--set` value is TOML, as in a file (see override_value), and is checked where a file's is: by
the section (config/base.py's coerce, then its validate()).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shlex
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from meshrun.config.base import field_types, fmt, parse_text, unwrap
from meshrun.config.sections import SECTIONS, JobConfig
from meshrun.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    try:
        import tomli as tomllib
    except ImportError:  # pragma: no cover - depends on the interpreter
        tomllib = None

OVERRIDE_FORM = "section.key=value (e.g. --set optim.lr=3e-4)"
_OVERRIDE = re.compile(r"^\s*([A-Za-z_]\w*)\.([A-Za-z_]\w*)\s*=(.*)$", re.DOTALL)
_TOML_AT = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")


def all_keys() -> list[str]:
    """Every dotted key, section by section, in declaration order: 'model.name', ..."""
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _keys_of(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


def suggest_key(key: str) -> str | None:
    """The valid dotted key closest to an unknown one: a near spelling in the (nearest) section,
    then the same key in another section ('train.lr' -> 'optim.lr'), then a near key anywhere."""
    section, _, name = key.rpartition(".")
    if section not in SECTIONS:
        close = difflib.get_close_matches(section, list(SECTIONS), n=1, cutoff=0.6)
        section = close[0] if close else ""
    if section:
        close = difflib.get_close_matches(name, _keys_of(section), n=1, cutoff=0.6)
        if close:
            return f"{section}.{close[0]}"
    by_name = {k.rpartition(".")[2]: k for k in reversed(all_keys())}  # first section wins
    close = difflib.get_close_matches(name, list(by_name), n=1, cutoff=0.8)
    return by_name[close[0]] if close else None


def _unknown_key(key: str, where: str) -> ConfigError:
    guess = suggest_key(key)
    if guess:
        return ConfigError(f"unknown key {key!r}{where}; did you mean {guess!r}?")
    section = key.partition(".")[0]
    if section in SECTIONS:
        return ConfigError(f"unknown key {key!r}{where}; [{section}] has: {', '.join(_keys_of(section))}")
    return ConfigError(f"unknown key {key!r}{where}; the sections are: {', '.join(SECTIONS)}")


def _check_keys(data: Mapping[str, Any], where: str) -> None:
    """Every table is a known section and every key a known field, or a did-you-mean error."""
    for section, table in data.items():
        if section not in SECTIONS:
            if isinstance(table, Mapping):
                close = difflib.get_close_matches(section, list(SECTIONS), n=1, cutoff=0.6)
                hint = f"did you mean [{close[0]}]?" if close else f"the sections are: {', '.join(SECTIONS)}"
                raise ConfigError(f"unknown section [{section}]{where}; {hint}")
            raise _unknown_key(section, where)
        if not isinstance(table, Mapping):
            raise ConfigError(
                f"{section!r} is a section{where}: write [{section}] and its keys below it, got {section} = {fmt(table)}"
            )
        for name in table:
            if name not in field_types(SECTIONS[section]):
                raise _unknown_key(f"{section}.{name}", where)


def config_from_dict(data: Mapping[str, Any], *, source: str = "") -> JobConfig:
    """A validated JobConfig from {section: {key: value}}; missing keys take their defaults."""
    _check_keys(data, f" in {source}" if source else "")
    return JobConfig(**{name: cls(**data.get(name, {})) for name, cls in SECTIONS.items()})


_NOT_TOML = object()


def toml_literal(text: str) -> Any:
    """`text` as one TOML value (what `v = TEXT` holds), or _NOT_TOML when it is not one."""
    if tomllib is None or not text:
        return _NOT_TOML
    try:
        doc = tomllib.loads(f"v = {text}")
    except (ValueError, RecursionError):  # TOMLDecodeError is a ValueError
        return _NOT_TOML
    return doc["v"] if doc.keys() == {"v"} else _NOT_TOML  # not `1\nw = 2`: one value only


def _unquote(word: str) -> str:
    word = word.strip()
    return word[1:-1] if len(word) >= 2 and word[0] == word[-1] and word[0] in "'\"" else word


def override_value(raw: str, hint: Any, key: str, *, list_ok: bool = False) -> Any:
    """One `--set` value, as TOML: an array or inline table is kept as a file's would be, so the
    section checks it (and refuses it in the same words); a TOML string for a string key is that
    string. Text that is not TOML for a list key, `[a, b]` (the shell ate the quotes of
    `["a", "b"]`), is the list of its words. Anything else is the text as the key's type
    (parse_text: true/yes/on/1, 3e-4, a bare word is a string, 'auto' for an optional key), or
    TOML's number where only TOML reads it (0x10)."""
    text = raw.strip()
    value = toml_literal(text)
    if isinstance(value, (list, dict)):
        return value
    if value is _NOT_TOML and list_ok and text.startswith("[") and text.endswith("]"):
        return [word for word in map(_unquote, text[1:-1].split(",")) if word]
    typ = unwrap(hint)[0]
    if isinstance(value, str) and typ is str:
        return value
    try:
        return parse_text(text, hint, key)  # its errors show the text as typed
    except ConfigError:
        if type(value) is int and typ in (int, float):
            return value  # an integer only TOML spells so: 0x10, 0o17, 0b101
        raise


def parse_override(text: str) -> tuple[str, str, Any]:
    """'optim.lr=3e-4' -> ('optim', 'lr', 0.0003): the value as TOML, else as that field's type
    (override_value); the section checks it when the config is built."""
    m = _OVERRIDE.match(text)
    if not m:
        raise ConfigError(f"--set expects {OVERRIDE_FORM}, got {text!r}")
    section, name, raw = m[1], m[2], m[3]
    key = f"{section}.{name}"
    if section not in SECTIONS or name not in field_types(SECTIONS[section]):
        raise _unknown_key(key, f" in --set {text}")
    field = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
    value = override_value(raw, field_types(SECTIONS[section])[name], key,
                           list_ok=field.metadata.get("list_ok", False))
    return section, name, value


def set_flag(key: str, value: Any) -> str:
    """`--set key=value` as a shell takes it: `--set 'metrics.trackers=[a,b]'`, `--set train.steps=20`."""
    return "--set " + shlex.quote(f"{key}={value}")


def merge_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of {section: {key: value}} with each `section.key=value` applied; the last wins."""
    merged = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}
    for text in overrides:
        section, name, value = parse_override(text)
        table = merged.setdefault(section, {})
        if isinstance(table, dict):  # otherwise _check_keys reports the malformed section
            table[name] = value
    return merged


def apply_overrides(cfg: JobConfig, overrides: Iterable[str]) -> JobConfig:
    """cfg with `section.key=value` overrides applied, validated as a whole."""
    return config_from_dict(merge_overrides(dataclasses.asdict(cfg), overrides))


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed TOML file, or a one-line ConfigError naming the path (and line, if any)."""
    if tomllib is None:
        raise ConfigError("reading TOML configs on Python 3.10 needs tomli: pip install tomli")
    shown = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(
            f"config file not found: {shown!r} (see examples/configs/, or give no file for the defaults)"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"config path {shown!r} is a directory; give a .toml file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {shown!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{shown}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise ConfigError(f"{shown}: nested too deeply to read (arrays or inline tables inside "
                          f"each other); meshrun configs are flat [section] tables of key = value") from None
    except tomllib.TOMLDecodeError as exc:
        msg = " ".join(str(exc).split())
        m = _TOML_AT.search(msg)
        where = f"{shown}:{m[1]}:{m[2]}" if m else shown
        msg = _TOML_AT.sub("", msg)
        raise ConfigError(f"{where}: invalid TOML: {msg}") from None
    except ValueError as exc:  # not a TOMLDecodeError: e.g. an integer past Python's digit limit
        raise ConfigError(f"{shown}: invalid TOML: {' '.join(str(exc).split())[:120]}") from None


def load_config(path: str | os.PathLike[str] | None = None, overrides: Iterable[str] = ()) -> JobConfig:
    """The job config from a TOML file (None = all defaults) with `--set` overrides applied.

    Every error is a one-line ConfigError that names the key, the value and what is expected.
    """
    data = read_toml(path) if path is not None else {}
    source = os.fspath(path) if path is not None else ""
    _check_keys(data, f" in {source}" if source else "")
    return config_from_dict(merge_overrides(data, overrides), source=source)


def set_hint(flag: str, value: str | None = None) -> str | None:
    """`--steps 20` -> "did you mean `--set train.steps=20`?" for a flag that names a config key
    (`--lr`, `--tp`, `--train.steps`, `--batch-size`); None when it names none."""
    name = flag.lstrip("-").replace("-", "_")
    if not name:
        return None
    if "." in name:
        keys = [name] if name in all_keys() else [k for k in [suggest_key(name)] if k]
    else:
        keys = [k for k in all_keys() if k.rpartition(".")[2] == name]
        if not keys:
            by_name = {k.rpartition(".")[2]: k for k in reversed(all_keys())}  # first section wins
            keys = [by_name[c] for c in difflib.get_close_matches(name, list(by_name), n=1, cutoff=0.8)]
    if not keys:
        return None
    shown = value if value is not None else "VALUE"
    options = " or ".join(f"`{set_flag(key, shown)}`" for key in keys)
    return f"did you mean {options}?"
