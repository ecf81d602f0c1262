"""What every config section shares: documented fields, type checks and one-line errors."""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any, ClassVar

from meshrun.errors import ConfigError

TRUE_WORDS = frozenset({"true", "yes", "on", "1"})
FALSE_WORDS = frozenset({"false", "no", "off", "0"})
INT_MAX = 2**63 - 1  # every int key fits int64: what torch tensors, seeds and JSON readers hold
AUTO = "auto"  # how TOML and --set spell None ("the default decides") for an optional field
EXPECTED = {
    bool: "true or false",
    int: "an integer",
    float: "a number (e.g. 3e-4)",
    str: "a string",
}


def doc_field(default: Any, doc: str, *, int_ok: bool = False, list_ok: bool = False) -> Any:
    """A dataclass field with its one-line doc; int_ok lets a str field take a bare integer, list_ok
    a TOML array of strings (kept as one comma-separated string: "a,b")."""
    metadata: dict[str, Any] = {"doc": doc}
    if int_ok:
        metadata["int_ok"] = True
    if list_ok:
        metadata["list_ok"] = True
    return dataclasses.field(default=default, metadata=metadata)


def fmt(value: Any) -> str:
    """A value as an error message or TOML reader would spell it, always on one short line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, (list, tuple)):
        return f"an array of {len(value)} item(s)"  # not repr: a deeply nested one would recurse
    if isinstance(value, int) and value.bit_length() > 200:
        return f"an integer of {value.bit_length()} bits"  # repr of a huge int is slow, or refused
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """{field name: resolved type} of a dataclass whose annotations are strings."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def unwrap(hint: Any) -> tuple[type, bool]:
    """(the scalar type, whether None is allowed) of `bool`, `bool | None`, ..."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        assert len(args) == 1, f"config fields are one scalar type or None, not {hint}"
        return args[0], True
    return hint, False


def expected(hint: Any) -> str:
    typ, optional = unwrap(hint)
    words = EXPECTED.get(typ, typ.__name__)
    return f"{words} or {AUTO!r}" if optional else words


def parse_text(text: str, hint: Any, key: str) -> Any:
    """A `--set key=TEXT` scalar as the field's type (arrays and tables: loader.override_value);
    errors say what the key expects and show the text as typed."""
    raw = text.strip()
    typ, optional = unwrap(hint)
    if optional and raw.lower() == AUTO:
        return None
    if typ is bool:
        word = raw.lower()
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
        auto = f", or {AUTO!r}" if optional else ""
        raise ConfigError(f"{key} must be true or false (or yes/no, on/off, 1/0{auto}), got {raw!r}")
    if typ is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{key} must be an integer, got {raw!r}") from None
    if typ is float:
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{key} must be a number (e.g. 3e-4), got {raw!r}") from None
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {raw!r}")
        return value
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]  # --set data.path='"my file"' survives shell quoting either way
    return raw


def coerce(value: Any, hint: Any, key: str, *, int_ok: bool = False, list_ok: bool = False) -> Any:
    """value if it has the field's type (an int also fits a float field); else a ConfigError.

    An optional field takes None, which TOML spells "auto".
    """
    typ, optional = unwrap(hint)
    if optional and (value is None or value == AUTO):
        return None
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if typ is str and list_ok and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = ",".join(value)
    if typ is bool and isinstance(value, bool):
        return value
    if typ is int and is_int:
        if abs(value) > INT_MAX:
            raise ConfigError(f"{key} must fit in 64 bits (|value| <= {INT_MAX}), got {fmt(value)}")
        return value
    if typ is float and (is_int or isinstance(value, float)):
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {fmt(value)}")
        return float(value)
    if typ is str and (isinstance(value, str) or (int_ok and is_int)):
        if "\x00" in str(value):
            raise ConfigError(f"{key} must not contain a NUL byte, got {fmt(value)}")
        return str(value)
    quoted = ""
    if isinstance(value, str) and typ is not str:
        try:
            parse_text(value, hint, key)
            quoted = " (a quoted string: write it without quotes)"
        except ConfigError:
            pass
    what = "an array of strings (or one comma-separated string)" if list_ok and typ is str else expected(hint)
    raise ConfigError(f"{key} must be {what}, got {fmt(value)}{quoted}")


class Section:
    """Base of every config section: checks each field's type, then the section's validate().

    Subclasses are frozen dataclasses that set `section` (their TOML table name); change one
    with `dataclasses.replace(cfg.optim, lr=1e-3)`, which validates again.
    """

    section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        types = field_types(type(self))
        for f in dataclasses.fields(typing.cast(Any, self)):
            value = getattr(self, f.name)
            new = coerce(value, types[f.name], self.key(f.name), int_ok=f.metadata.get("int_ok", False),
                         list_ok=f.metadata.get("list_ok", False))
            if new is not value:
                object.__setattr__(self, f.name, new)  # frozen: normalise once, at construction
        self.validate()

    def validate(self) -> None:
        """Range and choice checks of this section's values; each section adds its own."""

    def key(self, name: str) -> str:
        return f"{self.section}.{name}"

    def require(self, name: str, ok: bool, expected: str) -> None:
        """Raise `SECTION.NAME must be EXPECTED, got VALUE` unless ok."""
        if not ok:
            raise ConfigError(f"{self.key(name)} must be {expected}, got {fmt(getattr(self, name))}")

    def at_least(self, name: str, low: float, note: str = "") -> None:
        self.require(name, getattr(self, name) >= low, f">= {low}{note}")

    def one_of(self, name: str, choices: tuple[str, ...]) -> None:
        self.require(name, getattr(self, name) in choices, "one of " + ", ".join(map(repr, choices)))
