"""The experiment trackers `[metrics] trackers` may name, the extra each comes from, and the
pre-torch check that it is installed (`meshrun train` runs it before any worker starts).

    check_trackers_installed(("mlflow", "wandb"))   # ConfigError: one line naming the extra

Torch-free and imports no tracker: `importlib.util.find_spec` only.
"""

from __future__ import annotations

import importlib.util

from meshrun.errors import ConfigError

# name -> (the module `meshrun.metrics.trackers` imports, the pip extra that installs it)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
    "trackio": ("trackio", "trackio"),
}
KEY = "metrics.trackers"


def tracker_names(text: str) -> tuple[str, ...]:
    """'mlflow, wandb' -> ('mlflow', 'wandb'); the TOML array ["mlflow", "wandb"] arrives joined so."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def check_tracker_names(text: str) -> None:
    """Each name is a known tracker, named once; else one ConfigError line."""
    names = tracker_names(text)
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"{KEY}: unknown tracker {name!r}; choose from "
                              f"{', '.join(map(repr, TRACKERS))} (e.g. trackers = [\"tensorboard\", \"mlflow\"] in a "
                              f"config file, --set {KEY}=tensorboard,mlflow on the command line)")
    if len(set(names)) != len(names):
        raise ConfigError(f"{KEY} names a tracker twice, got {text!r}; name each once")


def installed(name: str) -> bool:
    """Whether tracker `name`'s library can be imported (found, not imported)."""
    module = TRACKERS[name][0]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_extra_message(name: str) -> str:
    """extras.py's one wording, plus this key's ways out."""
    from meshrun import extras

    return (extras.missing_extra_message(TRACKERS[name][0], f"{KEY} naming {name!r}")
            + f" (or 'meshrun[trackers]' for all four), or remove it from {KEY}")


def check_trackers_installed(names: tuple[str, ...]) -> None:
    """ConfigError (exit 2) for the first named tracker whose library is not installed."""
    for name in names:
        if not installed(name):
            raise ConfigError(missing_extra_message(name))
