"""What a valid manifest.json is: keys, types and ranges, and (version 2) its own sha256.

Version 2 manifests are written canonically (sorted keys, indent 1) and carry `manifest_sha256`,
the sha256 of the canonical text without that key. On read the file's bytes must equal the
canonical text of what they parse to, and the digest must match, so every change of the file,
even one that still parses to the same values, marks the checkpoint damaged. Version 1 (before
the digest) is still read, with the same field checks. A single bit flip cannot turn 2 into 1.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import PurePosixPath

VERSION = 2
SELF_SHA = "manifest_sha256"
MAX_MANIFEST_BYTES = 16 << 20
MAX_FILES = 1_000_000
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_REQUIRED = {"version", "step", "files"}
_OPTIONAL = {"layout", "session", "time"}


def _int(value, name: str, *, high: int = 1 << 63) -> int:
    if type(value) is not int or not 0 <= value < high:
        raise ValueError(f"{name} is {value!r}, not an integer in [0, {high})")
    return value


def check_manifest(manifest, text: str, *, step_dir: str = "") -> None:
    """Raise ValueError naming the first flaw of a parsed manifest (`text`: the file it came from)."""
    if not isinstance(manifest, dict):
        raise ValueError(f"holds a {type(manifest).__name__}, not an object")
    version = manifest.get("version")
    if type(version) is not int or version not in (1, VERSION):
        raise ValueError(f"version is {version!r}, not 1 or {VERSION}")
    allowed = _REQUIRED | _OPTIONAL | ({SELF_SHA} if version == VERSION else set())
    required = _REQUIRED | ({SELF_SHA} if version == VERSION else set())
    unknown = sorted(set(manifest) - allowed)
    if unknown:
        raise ValueError(f"has the unknown key {unknown[0]!r}")
    missing = sorted(required - set(manifest))
    if missing:
        raise ValueError(f"has no {missing[0]!r}")
    if version == VERSION:
        _check_digest(manifest, text)
    step = _int(manifest["step"], "step", high=10**8)
    match = _STEP_DIR.match(step_dir)
    if match and int(match.group(1)) != step:
        raise ValueError(f"step is {step}, but the directory is {step_dir}")
    _check_optional(manifest)
    _check_files(manifest["files"])


def _check_digest(manifest: dict, text: str) -> None:
    if json.dumps(manifest, indent=1, sort_keys=True) != text:
        raise ValueError("its bytes differ from what meshrun writes (edited or bit-flipped)")
    digest = manifest[SELF_SHA]
    body = {k: v for k, v in manifest.items() if k != SELF_SHA}
    if not isinstance(digest, str) or hashlib.sha256(json.dumps(body, indent=1, sort_keys=True).encode()
                                                     ).hexdigest() != digest:
        raise ValueError(f"{SELF_SHA} does not match its contents (edited or bit-flipped)")


def _check_optional(manifest: dict) -> None:
    if "session" in manifest:
        _int(manifest["session"], "session")
    if "time" in manifest:
        t = manifest["time"]
        if type(t) not in (int, float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"time is {t!r}, not a finite number of seconds")
    layout = manifest.get("layout", {})
    if not isinstance(layout, dict):
        raise ValueError(f"layout is a {type(layout).__name__}, not an object")
    for key, value in layout.items():
        if not isinstance(value, (str, int, float, bool, type(None))):
            raise ValueError(f"layout.{key} is a {type(value).__name__}, not a plain value")


def _check_files(files) -> None:
    if not isinstance(files, dict) or not files:
        raise ValueError("files is not a non-empty object")
    if len(files) > MAX_FILES:
        raise ValueError(f"files lists {len(files)} entries, more than {MAX_FILES}")
    for rel, entry in files.items():
        parts = PurePosixPath(rel).parts
        if rel.startswith("/") or not parts or ".." in parts or "\\" in rel or "\x00" in rel \
                or PurePosixPath(*parts).as_posix() != rel:
            raise ValueError(f"files has the path {rel!r}, not a plain path inside the checkpoint")
        if not isinstance(entry, dict) or set(entry) != {"bytes", "sha256"}:
            raise ValueError(f"files[{rel!r}] is not {{'bytes': N, 'sha256': HEX}}")
        _int(entry["bytes"], f"files[{rel!r}].bytes")
        if not isinstance(entry["sha256"], str) or not _HEX64.match(entry["sha256"]):
            raise ValueError(f"files[{rel!r}].sha256 is not 64 hex digits")
