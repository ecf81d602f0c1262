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
