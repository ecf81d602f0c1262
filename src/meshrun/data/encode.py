"""Batches of documents to token bytes, in input order, on one core or several.

    for done in encode_batches(batches, tokenizer, "uint16", workers=4):
        out.write(done.data)

Several workers are forked processes that each encode whole batches; results come back in the
order the batches went in, so the output is byte-for-byte the same for any number of workers
(the batches are cut by the readers, never by the worker count). At most 2 x workers batches
are in flight, so a large input streams through in bounded memory.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from array import array
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from meshrun.data.sources import Batch
from meshrun.data.tokenizer import ByteTokenizer, Tokenizer

TYPECODES = {"uint16": "H", "uint32": "I" if array("I").itemsize == 4 else "L"}
IN_FLIGHT_PER_WORKER = 2


@dataclass(frozen=True)
class Encoded:
    """One batch's token ids as little-endian bytes of the token file's dtype."""

    source: int
    done_bytes: int
    data: bytes
    num_tokens: int
    num_documents: int


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under taskset or a SLURM allocation)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def encode_batch(batch: Batch, tokenizer: Tokenizer, dtype: str, *, batched: bool = False) -> Encoded:
    """Encode each document of `batch`, with the end-of-text id after each when `batch.eos`.

    batched: one `encode_batch` call for all texts where the tokenizer has one (in workers,
    whose tokenizer threads are off); else `encode` per text.
    """
    texts = batch.documents()
    eos = tokenizer.eos_id if batch.eos else None
    code = TYPECODES[dtype]
    eos_bytes = b"" if eos is None else array(code, [eos]).tobytes()
    parts: list[bytes] = []
    num_tokens = 0
    if type(tokenizer) is ByteTokenizer and dtype == "uint16":  # not a subclass: it may encode differently
        for text in texts:
            raw = text.encode("utf-8")
            wide = bytearray(2 * len(raw))
            wide[0::2] = raw  # each byte becomes a little-endian uint16
            parts += (wide, eos_bytes)
            num_tokens += len(raw)
    else:
        encode_many = getattr(tokenizer, "encode_batch", None) if batched else None
        all_ids = encode_many(texts) if encode_many else [tokenizer.encode(t) for t in texts]
        for ids in all_ids:
            parts += (array(code, ids).tobytes(), eos_bytes)
            num_tokens += len(ids)
    if eos is not None:
        num_tokens += len(texts)
    return Encoded(batch.source, batch.done_bytes, b"".join(parts), num_tokens, len(texts))


# -- worker processes ------------------------------------------------------------------------------

_worker_state: tuple[Tokenizer, str] | None = None


def _init_worker(tokenizer: Tokenizer, dtype: str) -> None:
    global _worker_state
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent stops the pool, one line, no tracebacks
    # the pool's terminate() must end a worker whatever SIGTERM handler the parent held when it forked
    # (a flag-only preemption handler made terminate() wait for ever on an idle worker)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: --workers counts the cores used
    torch = sys.modules.get("torch")  # a library caller's: its threads would only compete with the workers
    if torch is not None:
        torch.set_num_threads(1)
    _worker_state = (tokenizer, dtype)


def _encode_in_worker(batch: Batch) -> Encoded:
    assert _worker_state is not None, "_init_worker did not run"
    tokenizer, dtype = _worker_state
    return encode_batch(batch, tokenizer, dtype, batched=True)


def _start_method() -> str:
    # fork: the workers inherit the loaded tokenizer instead of loading it again; where fork is missing, spawn pickles the tokenizer.
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def effective_workers(tokenizer: Tokenizer, workers: int) -> int:
    """Processes worth starting: 1 for the byte tokenizer, whose encoding is a copy, cheaper than
    sending the text to a worker and the ids back (half the speed on 2 workers, measured by
    benchmarks/data_prepare.py --tokenizer byte)."""
    return 1 if type(tokenizer) is ByteTokenizer else max(1, workers)


def encode_batches(batches: Iterable[Batch], tokenizer: Tokenizer, dtype: str, *,
                   workers: int = 1) -> Iterator[Encoded]:
    """`encode_batch` of each batch, in order: in this process when `effective_workers` is 1,
    else in that many worker processes."""
    workers = effective_workers(tokenizer, workers)
    if workers == 1:
        for batch in batches:
            yield encode_batch(batch, tokenizer, dtype)
        return
    ctx = multiprocessing.get_context(_start_method())
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer, dtype)) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

