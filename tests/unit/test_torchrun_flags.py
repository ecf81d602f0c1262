"""meshrun's torch-free copy of torchrun's parser matches torch's own, flag by flag.

If a torch release adds, renames or re-defaults a flag, this fails here instead of a user's
launch behaving differently from torchrun.
"""

from __future__ import annotations

import sys

import pytest

from meshrun.errors import LaunchError
from meshrun.launch.torchrun_flags import torchrun_parser


def _describe(parser) -> dict[str, tuple]:
    rows = {}
    for action in parser._actions:
        if action.dest == "help":
            continue
        typ = getattr(action.type, "__name__", action.type)
        rows[action.dest] = (tuple(action.option_strings), action.default, typ,
                             tuple(action.choices or ()), action.nargs, type(action).__name__, action.required)
    return rows


def test_the_copy_matches_torchs_parser(monkeypatch):
    from torch.distributed.run import get_args_parser

    for key in [k for k in __import__("os").environ if k.startswith("PET_")]:
        monkeypatch.delenv(key)
    assert _describe(torchrun_parser()) == _describe(get_args_parser())


def test_pet_environment_defaults_as_in_torch(monkeypatch):
    monkeypatch.setenv("PET_NNODES", "2")
    monkeypatch.setenv("PET_STANDALONE", "1")
    args = torchrun_parser().parse_args(["x.py"])
    assert args.nnodes == "2" and args.standalone is True


def test_parse_errors_are_one_line(monkeypatch):
    with pytest.raises(LaunchError, match=r"--master-port.*invalid int value: 'abc'") as info:
        torchrun_parser().parse_args(["--master-port", "abc", "x.py"])
    assert "\n" not in str(info.value)
    with pytest.raises(LaunchError, match="required: training_script"):
        torchrun_parser().parse_args([])


def test_parsing_imports_no_torch():
    import subprocess

    probe = ("import sys; from meshrun.launch.args import build_parser; "
             "build_parser().parse_args(['--nnodes', '2', 'x.py']); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr
