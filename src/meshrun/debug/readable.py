"""What a person reads of a failure: the user's frames, without C++ frames or meshrun's wrappers.

torch appends its C++ stack to some messages ("Exception raised from ... frame #0: ...", or
"C++ CapturedTraceback:" with TORCH_SHOW_CPP_STACKTRACES=1), and a collective called under
`meshrun launch` passes through meshrun's wrappers (debug/collectives.py), whose frames say
nothing about the user's bug. Both are left out of what meshrun prints unless the user asked
for everything: `meshrun launch --verbose` (MESHRUN_VERBOSE=1 for the workers).

Standard library only: the launch bootstrap uses it when a worker fails.
"""

from __future__ import annotations

import os
import re

VERBOSE_ENV = "MESHRUN_VERBOSE"
MESHRUN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

# Where torch's C++ stack starts inside a message, and the lines that belong to one.
_CPP_START = re.compile(r"^(Exception raised from .* \(most recent call first\):|C\+\+ CapturedTraceback:)\s*$")
_CPP_LINE = re.compile(r"^(frame #\d+:|#\d+ |<omitting python frames>|C\+\+ CapturedTraceback:|\s*$)")
_FAULTHANDLER_FRAME = re.compile(r'^\s*File "([^"]+)", line \d+ in ')


def verbose(environ=None) -> bool:
    """The user asked for every frame (`meshrun launch --verbose`, or MESHRUN_VERBOSE=1)."""
    environ = os.environ if environ is None else environ
    return environ.get(VERBOSE_ENV, "") not in ("", "0")


def is_cpp_line(line: str) -> bool:
    """A line of a C++ stack as torch prints it (in a message or a c10 log line)."""
    return bool(_CPP_START.match(line.strip())) or bool(re.match(r"^\s*frame #\d+:", line)) \
        or line.strip() == "<omitting python frames>"


def strip_cpp(text: str) -> str:
    """`text` without the C++ stack torch appended to it (the message before it is kept)."""
    lines = str(text).splitlines()
    for i, line in enumerate(lines):
        if _CPP_START.match(line.strip()):  # c10::Error's what(): the message, then only its stack
            return "\n".join(lines[:i]).rstrip()
    return str(text)


def is_meshrun_file(path: str) -> bool:
    return os.path.abspath(path).startswith(MESHRUN_DIR)


def is_user_file(path: str) -> bool:
    """The user's own code: not meshrun, not the standard library or an installed package."""
    import sys

    path = os.path.abspath(path)
    libraries = tuple(os.path.abspath(p) + os.sep for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
    return not (path.startswith(libraries) or "site-packages" in path or is_meshrun_file(path)
                or path.startswith("<"))


def user_frames(frames: list) -> list:
    """traceback.FrameSummary items without meshrun's wrapper frames around the user's code.

    Only where the user's own code is in the traceback: under `meshrun train` meshrun's frames are
    the program, not a wrapper, and stay.
    """
    if not any(is_user_file(f.filename) for f in frames):
        return frames
    return [f for f in frames if not is_meshrun_file(f.filename)]


def format_exception(exc: BaseException, tb, *, full: bool = False) -> str:
    """The traceback as Python prints it; unless `full`, without meshrun's frames and C++ stacks."""
    import traceback

    if full:
        return "".join(traceback.format_exception(type(exc), exc, tb))
    frames = user_frames(traceback.extract_tb(tb))
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames)] if frames else []
    head = traceback.format_exception_only(type(exc), exc)
    lines.append(strip_cpp("".join(head)).rstrip("\n") + "\n")
    return "".join(lines)


def readable_lines(lines: list[str]) -> list[str]:
    """Log lines without C++ stack lines and without meshrun's frames in faulthandler dumps."""
    kept, in_cpp = [], False
    for line in lines:
        if _CPP_START.match(line.strip()):
            in_cpp = True
            continue
        if in_cpp and _CPP_LINE.match(line):
            continue
        in_cpp = False
        if is_cpp_line(line):
            continue
        frame = _FAULTHANDLER_FRAME.match(line)
        if frame and is_meshrun_file(frame.group(1)):
            continue
        kept.append(line)
    return kept
