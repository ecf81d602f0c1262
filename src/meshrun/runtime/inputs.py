"""Files a user names: opened one way, so a wrong one is one line and never a hang or a traceback.

`user_file(key, path)` is the file under config key (or flag) `key`, symlinks resolved: a regular
file of at most `limit` bytes, or a ConfigError that names the key, the path (and where a
symlink led) and why. A FIFO would block the reader for ever, a device (a weights file linked to
/dev/zero) never ends, and an oversized file is read whole by JSON and tokenizer parsers: all
are refused before anything opens them. `read_text` and `read_json` read such a file.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from meshrun.errors import ConfigError, shown

TEXT_LIMIT = 64 << 20  # config.json, tokenizer.json, pointers, index files: far below this


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (a reader would wait for a writer for ever)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def user_file(key: str, path: str | os.PathLike[str], *, limit: int | None = None, fix: str = "") -> Path:
    """The regular file `path` names (symlinks resolved), checked before anyone opens it."""
    given = Path(path).expanduser()
    where = f"{key}={shown(str(path))}"
    try:
        real = given.resolve(strict=True)
        info = real.stat()
    except FileNotFoundError:
        raise ConfigError(f"{where} not found{'; ' + fix if fix else ''}") from None
    except (OSError, RuntimeError) as exc:  # a loop, a name too long, a directory it cannot search
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(f"{where} is not a usable path ({reason}){'; ' + fix if fix else ''}") from None
    led = f" (a symlink to {shown(str(real))})" if real != given.absolute() and given.is_symlink() else ""
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{where}{led} is {_kind(info.st_mode)}, not a regular file{'; ' + fix if fix else ''}")
    if limit is not None and info.st_size > limit:
        raise ConfigError(f"{where}{led} is {info.st_size} bytes, more than the {limit} such a file can be"
                          f"{'; ' + fix if fix else ''}")
    return real


def read_text(key: str, path: str | os.PathLike[str], *, limit: int = TEXT_LIMIT, fix: str = "") -> str:
    """A user's text file, whole: UTF-8, a regular file of at most `limit` bytes (user_file)."""
    real = user_file(key, path, limit=limit, fix=fix)
    try:
        with open(real, "rb") as fp:
            data = fp.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{key}={shown(str(path))} cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:  # it grew since the check
        raise ConfigError(f"{key}={shown(str(path))} is more than the {limit} bytes such a file can be")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{key}={shown(str(path))} is not UTF-8 text (byte {exc.start}){'; ' + fix if fix else ''}") \
            from None


def read_json(key: str, path: str | os.PathLike[str], *, limit: int = TEXT_LIMIT, fix: str = "") -> Any:
    """A user's JSON file, parsed (read_text's checks, then one line for invalid JSON)."""
    text = read_text(key, path, limit=limit, fix=fix)
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        detail = " ".join(str(exc).split()) if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        raise ConfigError(f"{key}={shown(str(path))} is not valid JSON ({detail})") from None
