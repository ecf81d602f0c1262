"""train.compile's cache directory: private to its owner or not used, and the ISA probe's record."""

from __future__ import annotations

import logging
import os
import platform
import shutil
import stat
import sys

import pytest

from meshrun.parallel.compile_cache import CACHE_DIR, ISA_RECORD, settle_vec_isa, use_run_cache


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_cache_is_owner_only_and_an_open_or_foreign_one_is_not_used(tmp_path, caplog):
    (tmp_path / CACHE_DIR).mkdir(mode=0o755)  # an older meshrun's: private enough, and now owner-only
    env: dict[str, str] = {}
    cache = use_run_cache(tmp_path, env)
    assert cache == tmp_path.resolve() / CACHE_DIR and _mode(cache) == 0o700
    cache.chmod(0o777)  # anyone could plant a pickle or a shared object in it
    env = {}
    with caplog.at_level(logging.WARNING):
        fresh = use_run_cache(tmp_path, env)
    try:
        assert fresh != cache and env["TORCHINDUCTOR_CACHE_DIR"] == str(fresh) and _mode(fresh) == 0o700
        assert not any(fresh.iterdir()), "cold: a fresh, empty directory"
        assert f"not using the compile cache {cache}: it is group- or world-writable (mode 777)" in caplog.text
        assert "chmod 700" in caplog.text
    finally:
        shutil.rmtree(fresh)
    if os.getuid() == 0:  # root can give it away: another user's directory, even private, is refused
        cache.chmod(0o700)
        os.chown(cache, 1, 1)
        env = {}
        fresh = use_run_cache(tmp_path, env)
        shutil.rmtree(fresh)
        assert fresh != cache and "it is owned by uid 1, not by you (uid 0)" in caplog.text


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="torch probes x86-64 Linux only")
def test_the_isa_probe_runs_once_per_cache(tmp_path, monkeypatch):
    from torch._inductor import config, cpu_vec_isa

    with config.patch({"cpp.vec_isa_ok": False}):  # the user's own setting is kept, nothing recorded
        assert settle_vec_isa(tmp_path) is False and not (tmp_path / ISA_RECORD).exists()
    with config.patch({"cpp.vec_isa_ok": None}):
        if not settle_vec_isa(tmp_path):  # some ISA failed its probe here: torch keeps probing
            assert not (tmp_path / ISA_RECORD).exists()
            return
        assert config.cpp.vec_isa_ok is True and (tmp_path / ISA_RECORD).exists()
    with config.patch({"cpp.vec_isa_ok": None}):  # a restarted worker: the record stands for the probe

        def probe():
            raise AssertionError("probed again")

        monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", probe)
        assert settle_vec_isa(tmp_path) is True and config.cpp.vec_isa_ok is True
    with config.patch({"cpp.vec_isa_ok": None}):
        (tmp_path / ISA_RECORD).write_text('{"torch": "another version"}')  # not this torch/CPU/compiler
        with pytest.raises(AssertionError, match="probed again"):
            settle_vec_isa(tmp_path)
