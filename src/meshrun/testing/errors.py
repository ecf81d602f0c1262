"""What `run_distributed` raises: a failed rank, a rank that died, a timeout, an unpicklable fn."""

from __future__ import annotations

from meshrun.errors import MeshrunError


class DistributedTestError(RuntimeError):
    """A rank raised. The message starts with ``rank R failed: Type: text`` and holds its traceback.

    rank: the rank that failed first. exc_type: the exception's type name (``"ValueError"``,
    ``"mypkg.MyError"``), or None when the rank died without raising. remote_traceback: the
    traceback text from the child. exception: the original exception, unpickled in this
    process, or None when it could not be.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        exc_type: str | None = None,
        remote_traceback: str = "",
        exception: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.exception = exception


class RankExitedError(DistributedTestError):
    """A rank ended without raising: ``os._exit``, a signal (SIGKILL, SIGSEGV), or an abort at exit.

    exitcode: the process exit code, negative for a signal (multiprocessing's convention).
    signal_name: ``"SIGKILL"`` etc. when a signal ended it, else None.
    """

    def __init__(
        self, message: str, *, rank: int, exitcode: int | None, signal_name: str | None
    ) -> None:
        super().__init__(message, rank=rank)
        self.exitcode = exitcode
        self.signal_name = signal_name


class DistributedTimeoutError(TimeoutError):
    """The ranks did not all finish within the timeout; every child was killed.

    timeout: the limit in seconds. ranks: the ranks that had not finished. stacks: each of those
    ranks' Python stacks at the timeout, by rank (empty where none could be taken).
    """

    def __init__(
        self, message: str, *, timeout: float, ranks: list[int], stacks: dict[int, str]
    ) -> None:
        super().__init__(message)
        self.timeout = timeout
        self.ranks = ranks
        self.stacks = stacks


class NotPicklableError(MeshrunError, TypeError):
    """fn, args or kwargs cannot be pickled, so spawned ranks could not receive them."""
