"""Write a JobConfig back out: TOML that loads to the same config, a dict, and `config show`."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from meshrun.config.base import AUTO
from meshrun.config.sections import SECTIONS, JobConfig
from meshrun.runtime.files import follow_umask

CONFIG_FILE = "config.toml"
"""The resolved config's file name in a run directory (runs/<name>/config.toml)."""
HEADER = "# meshrun train config. Run it with: meshrun train THIS_FILE [--set section.key=value ...]\n"


def as_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """{section: {key: value}} of plain Python values, in declaration order."""
    return dataclasses.asdict(cfg)


def toml_value(value: Any) -> str:
    """One value in TOML syntax; floats use repr so they read back bit for bit."""
    if value is None:  # TOML has no null: optional fields spell None "auto"
        return json.dumps(AUTO)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        # JSON string escapes are all valid TOML basic-string escapes; TOML also bans raw DEL.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    raise TypeError(f"no TOML form for {type(value).__name__}: {value!r}")


def _rows(cfg: JobConfig):
    """(section, its doc, [(key, value, default, doc)]) for every section, in order."""
    for name, cls in SECTIONS.items():
        section = getattr(cfg, name)
        rows = [
            (f.name, getattr(section, f.name), f.default, f.metadata["doc"])
            for f in dataclasses.fields(cls)
        ]
        yield name, (cls.__doc__ or "").strip().splitlines()[0], rows


def to_toml(cfg: JobConfig, *, docs: bool = False) -> str:
    """The config as TOML that load_config reads back to an equal JobConfig.

    docs=True puts each section's and each key's one-line doc above it as a comment.
    """
    out = [HEADER]
    for name, section_doc, rows in _rows(cfg):
        out.append(f"\n# {section_doc}\n[{name}]\n" if docs else f"\n[{name}]\n")
        for key, value, _default, doc in rows:
            if docs:
                out.append(f"# {doc}\n")
            out.append(f"{key} = {toml_value(value)}\n")
    return "".join(out)


def save_config(cfg: JobConfig, path: str | os.PathLike[str]) -> Path:
    """Write to_toml(cfg) to path (e.g. runs/<name>/config.toml) atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(to_toml(cfg, docs=True))
        follow_umask(tmp)  # mkstemp makes 0600; a config is as readable as any file the user writes
        os.replace(tmp, path)  # readers never see a half-written config
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def describe(cfg: JobConfig, notes: tuple[str, ...] = ()) -> str:
    """Every key with its resolved value, its default and its doc, by section (`config show`).

    The text is itself valid TOML, so `meshrun config show > my.toml` gives a loadable file.
    `notes` are one-line comments printed under the header (e.g. the world size the parallel
    degrees were resolved for).
    """
    out = [
        "# Resolved meshrun train config: key = value  # [default] when unchanged, else "
        "[default: X]; then what the key means.\n"
    ]
    out += [f"# {' '.join(note.split())}\n" for note in notes]
    for name, section_doc, rows in _rows(cfg):
        out.append(f"\n[{name}]  # {section_doc}\n")
        keys = [k for k, *_ in rows]
        values = [toml_value(v) for _, v, _, _ in rows]
        marks = ["[default]" if v == d else f"[default: {toml_value(d)}]" for _, v, d, _ in rows]
        kw, vw, mw = (max(map(len, col)) for col in (keys, values, marks))
        for key, value, mark, (_, _, _, doc) in zip(keys, values, marks, rows, strict=True):
            out.append(f"{key:<{kw}} = {value:<{vw}}  # {mark:<{mw}}  {doc}\n")
    return "".join(out)
