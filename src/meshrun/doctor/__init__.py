"""`meshrun doctor`'s checks, in report order, and the verdict; the CLI only formats them.

    from meshrun.doctor import run_checks, summarize
    report = run_checks(timeout=60)       # list[Check(name, status, detail, fix)]
    summarize(report)["ok"]               # False when any check FAILs
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

from meshrun.doctor import checks, env_checks
from meshrun.doctor.checks import FAIL, INFO, PASS, STATUSES, WARN, Check

__all__ = ["Check", "PASS", "WARN", "FAIL", "INFO", "run_checks", "summarize"]

logger = logging.getLogger(__name__)


def _guarded(name: str, fn: Callable[[], Check | list[Check]]) -> list[Check]:
    """A check that crashes is reported as a FAIL of that check, not a traceback of the doctor."""
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - a doctor must finish its report
        logger.debug("check %s crashed", name, exc_info=True)
        return [Check(name, FAIL, f"the check itself crashed: {type(exc).__name__}: {exc}",
                      "report this as a meshrun bug, with the output of `meshrun doctor --json`")]
    return result if isinstance(result, list) else [result]


def run_checks(
    *,
    environ: Mapping[str, str] | None = None,
    port: int | None = None,
    timeout: float = 60.0,
    skip_smoke: bool = False,
    on_smoke: Callable[[str], None] | None = None,
) -> list[Check]:
    """Install checks, then what breaks launches, then the live smoke test(s), in that order.

    `on_smoke(backend)` is called before each live test starts (the CLI prints progress).
    """
    environ = os.environ if environ is None else environ
    steps: list[tuple[str, Callable[[], Check | list[Check]]]] = [
        ("torch", checks.check_torch),
        ("devices", checks.check_devices),
        ("distributed", checks.check_distributed),
        ("backends", checks.check_backends),
        ("hostname", checks.check_hostname),
        ("loopback", checks.check_loopback),
        ("shm", lambda: checks.check_shm(checks.shm_usage())),
        ("launch env", lambda: env_checks.check_launch_env(environ)),
        ("nccl env", lambda: env_checks.check_nccl_env(environ)),
        ("omp threads", lambda: env_checks.check_omp(environ)),
    ]
    report = [check for name, fn in steps for check in _guarded(name, fn)]
    backends = _smoke_backends(report)
    if not backends:
        report.append(Check("smoke", INFO, "not run: no usable backend (see the checks above)",
                            "fix the failed torch.distributed/gloo checks, then rerun `meshrun doctor`"))
    for backend in backends:
        if skip_smoke:
            report.append(Check(f"smoke {backend}", INFO, "skipped (--skip-smoke)",
                                "run `meshrun doctor` without --skip-smoke to test a real 2-process all_reduce"))
            continue
        if on_smoke is not None:
            on_smoke(backend)
        report += _guarded(f"smoke {backend}", lambda b=backend: _smoke(b, port, timeout, environ))
    return report


def _smoke_backends(report: list[Check]) -> list[str]:
    """gloo always (when present); NCCL too when it is available and >= 2 CUDA GPUs exist."""
    available = {check.name for check in report if check.status == PASS}
    backends = ["gloo"] if "gloo" in available else []
    if "nccl" in available:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
            backends.append("nccl")
    return backends


def _smoke(backend: str, port: int | None, timeout: float, environ: Mapping[str, str]) -> Check:
    from meshrun.doctor.smoke import run_smoke

    return run_smoke(backend, port=port, timeout=timeout, environ=environ)


def summarize(report: list[Check]) -> dict[str, object]:
    """Counts per status, the failed check names, `ok` and a one-line verdict."""
    counts = {status: sum(check.status == status for check in report) for status in STATUSES}
    failed = [check.name for check in report if check.status == FAIL]
    ok = not failed
    if ok:
        warned = counts[WARN]
        verdict = "READY: no check failed" + (f" ({warned} warning{'s' * (warned != 1)} to read)" if warned else "")
    else:
        verdict = f"NOT READY: {len(failed)} check{'s' * (len(failed) != 1)} failed ({', '.join(failed)})"
    return {
        "ok": ok,
        "passed": counts[PASS],
        "warned": counts[WARN],
        "failed": counts[FAIL],
        "info": counts[INFO],
        "failed_checks": failed,
        "verdict": verdict,
    }
