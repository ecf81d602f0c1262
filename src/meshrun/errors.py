"""Typed errors for bad user input: each message names the key or value and the fix."""

from __future__ import annotations


class MeshrunError(Exception):
    """A problem the user can fix. The CLI prints it as one line and exits 2."""

    exit_code = 2


class EnvError(MeshrunError):
    """A launcher environment variable (RANK, WORLD_SIZE, MASTER_*, ...) is missing or malformed."""


class LaunchError(MeshrunError):
    """The launch command or its options cannot work as given."""


class WorldSizeError(MeshrunError):
    """The script needs more processes than it was started with."""


class ConfigError(MeshrunError):
    """A config key or value is wrong: the message names the key, the value and what is expected."""


class DataError(MeshrunError):
    """A data file is missing, corrupt or does not fit the config."""


class ModelError(MeshrunError):
    """The model cannot be built as configured (e.g. a factory that does not import)."""


class DiskWriteError(MeshrunError):
    """A file could not be written (no space, read-only, I/O error): the job stops, nothing committed is lost."""

    exit_code = 1  # a failed job, not bad input


def shown(value: object, width: int = 80) -> str:
    """`value` quoted for a one-line message, cut at `width` characters (a path may be thousands)."""
    text = str(value)
    return f"{text[:width]!r}..." if len(text) > width else repr(text)
