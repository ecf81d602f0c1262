"""train.compile's cache: `<run dir>/compile-cache`, private to its owner, and what makes a warm start fast.

Inductor's FX graph cache and AOTAutograd's cache hold pickles and shared objects that a
restarted worker loads and runs. So the directory is owner-only (0700), and one that another
user owns or can write to (group/world-writable, as ssh refuses such key files) is not used:
one warning, and the worker compiles cold into a fresh private directory (`use_run_cache`).

A warm start (every kernel a cache hit) spent a third of its time, measured on tiny with block
graphs, in inductor's CPU ISA probe: for each ISA the CPU reports (avx2, avx512, ...) it builds
a probe library and starts a Python child to dlopen it, in every process that compiles
(torch/_inductor/cpu_vec_isa.py `VecISA.check_build`). `settle_vec_isa` runs that probe once per
cache: when every ISA the CPU reports builds and loads, it records so in the cache directory
(keyed by torch's version, the CPU's ISAs and the compiler's path, size and mtime) and sets
inductor's `cpp.vec_isa_ok`, which skips the probe. Later starts read the record instead of
probing. The setting is part of inductor's cache key, so the cold compile and every warm start
set it alike; a CPU or compiler that fails any probe keeps torch's own per-process check.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import stat
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger("meshrun.parallel.compile")

CACHE_DIR = "compile-cache"  # under the run directory
# Inductor reads these (torch/_inductor/runtime/cache_dir_utils.py, torch/_inductor/config.py
# fx_graph_cache, torch/_functorch/config.py enable_autograd_cache); triton's cache lives under
# TORCHINDUCTOR_CACHE_DIR unless TRITON_CACHE_DIR says otherwise.
CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE")
ISA_RECORD = "meshrun-vec-isa.json"  # in the cache directory: the probe's verdict (settle_vec_isa)


def use_run_cache(run_dir: Path, environ: dict[str, str] | None = None) -> Path:
    """Point inductor's caches at `<run_dir>/compile-cache`, keeping a directory the user chose.

    Call it before the first compile (the worker does, before building the model): inductor
    reads the variables each time it opens its cache. Importing torch._dynamo writes torch's
    default (/tmp/torchinductor_<user>) into TORCHINDUCTOR_CACHE_DIR (torch/_dynamo/package.py,
    torch 2.13), in the launcher too, so that value counts as unset. The run's directory is made
    0700 (a directory the user chose keeps its mode); one that is not private (`not_private`)
    is replaced by a fresh private one. Returns the directory in use.
    """
    environ = os.environ if environ is None else environ
    ours = environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, "", _torch_default_cache_dir())
    if ours:
        environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(run_dir).resolve() / CACHE_DIR)
    environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    path = Path(environ["TORCHINDUCTOR_CACHE_DIR"])
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        reason = not_private(path)
    except OSError as exc:
        reason = f"it cannot be created or read ({exc.strerror})"
    if reason is not None:
        fresh = tempfile.mkdtemp(prefix="meshrun-compile-cache-")  # 0700, ours
        warn_once("train.compile: not using the compile cache %s: %s (its pickles and shared objects would be "
                  "loaded and run); compiling cold into %s. Fix: chown it to yourself and chmod 700 it, or "
                  "delete it", path, reason, fresh)
        environ["TORCHINDUCTOR_CACHE_DIR"] = fresh
        return Path(fresh)
    if ours:
        path.chmod(0o700)  # one an older meshrun made 0755
    return path


def compiler_path() -> str | None:
    """The C++ compiler inductor will call ($CXX, else g++; clang++ on macOS), or None if absent."""
    name = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    return shutil.which(name)


def warn_once(message: str, *args: object) -> None:
    """A warning from rank 0 only: every rank decides alike, and one line says it for the job."""
    if _rank() == 0:
        logger.warning(message, *args)


def _rank() -> int:
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def not_private(path: Path) -> str | None:
    """Why `path` is not a private directory (another owner, group/world-writable), or None if it is."""
    if not hasattr(os, "getuid"):  # Windows: no owner/mode bits to check
        return None
    info = path.stat()
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory"
    if info.st_uid != os.getuid():
        return f"it is owned by uid {info.st_uid}, not by you (uid {os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is group- or world-writable (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _torch_default_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


def settle_vec_isa(cache_dir: Path | None = None) -> bool:
    """Skip inductor's per-process ISA probe when this cache's record says it passes; True if skipped.

    Call before the first compile in a process (apply_compile does). x86-64 Linux only (where
    torch probes); a `cpp.vec_isa_ok` the user set (TORCHINDUCTOR_VEC_ISA_OK) is kept.
    """
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    from torch._inductor import config

    if config.cpp.vec_isa_ok is not None:
        return bool(config.cpp.vec_isa_ok)
    cache_dir = Path(cache_dir or os.environ.get("TORCHINDUCTOR_CACHE_DIR") or _torch_default_cache_dir())
    try:  # torch's private module: another torch may lack these; then torch probes as it always did
        from torch._inductor import cpu_vec_isa

        flags = cpu_vec_isa.x86_isa_checker()
        candidates = [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list
                      if all(flag in flags for flag in str(isa).split())]
    except (ImportError, AttributeError):
        return False
    key = {"torch": _torch_version(), "isas": candidates, "compiler": _file_id(compiler_path())}
    record = cache_dir / ISA_RECORD
    if _read_json(record) != key:
        if not candidates or [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()] != candidates:
            return False  # some ISA failed its probe: torch keeps checking in each process
        _write_json(record, key)
    config.cpp.vec_isa_ok = True
    return True


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _file_id(path: str | None) -> list | None:
    if path is None:
        return None
    info = os.stat(path)
    return [os.path.realpath(path), info.st_size, info.st_mtime_ns]


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, value: object) -> None:
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as fh:
            json.dump(value, fh)
        os.replace(fh.name, path)  # ranks on one node may write it at once: whole or not at all
    except OSError:
        pass  # a read-only cache: the next start probes again
