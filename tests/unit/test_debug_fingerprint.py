"""Fingerprint comparison (debug/fingerprint.py) over a real c10d HashStore, ranks as threads:
the majority names the diverging rank, a finished peer means an extra call, an absent one is named."""

from __future__ import annotations

import threading

import torch.distributed as dist

from meshrun.debug.fingerprint import Checker, CollectiveMismatchError
from meshrun.debug.heartbeat import CollectiveRecord


def _run_ranks(calls: dict[int, list[tuple[str, str, str]]], world: int, *, arrival_timeout_s: float = 5.0,
               finish: set[int] = frozenset()) -> dict[int, str]:
    """Each rank checks its calls in order; returns rank -> error text ('' when none)."""
    store = dist.HashStore()
    results: dict[int, str] = {}

    def rank_main(rank: int) -> None:
        checker = Checker(store, rank, world, arrival_timeout_s)
        try:
            for seq, (op, tensors, site) in enumerate(calls[rank], start=1):
                checker.check(CollectiveRecord(seq, op, "world", tensors, site), None)
            results[rank] = ""
        except CollectiveMismatchError as exc:
            results[rank] = str(exc)
        if rank in finish:
            checker.mark_done()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank did not finish: the check hung"
    return results


def test_majority_names_the_rank_with_a_different_op():
    same = [("all_reduce", "float32[4]", "t.py:5 in f")]
    odd = [("broadcast", "float32[4]", "t.py:9 in g")]
    results = _run_ranks({0: same, 1: same, 2: odd}, 3)
    assert all("rank 2 diverged" in text and "broadcast(float32[4]) at t.py:9" in text for text in results.values())


def test_shape_mismatch_between_two_ranks_is_reported_on_both():
    results = _run_ranks({0: [("all_reduce", "float32[4]", "t.py:5 in f")],
                          1: [("all_reduce", "float32[8]", "t.py:5 in f")]}, 2)
    assert all("collective mismatch at #1" in text and "float32[8]" in text for text in results.values())


def test_extra_call_against_a_finished_peer_names_the_extra_line():
    loop = ("all_reduce", "float32[4]", "t.py:5 in loop")
    extra = ("all_reduce", "float32[4]", "t.py:7 in loop")
    results = _run_ranks({0: [loop, loop], 1: [loop, extra, loop]}, 2, finish={0})
    assert results[0] == ""
    assert "rank 1 diverged first: its #2 all_reduce(float32[4]) at t.py:7 in loop" in results[1]
    assert "rank 0, which finished after 2" in results[1]


def test_a_peer_that_never_arrives_is_named():
    call = ("all_reduce", "float32[4]", "t.py:5 in f")
    results = _run_ranks({0: [call, call], 1: [call]}, 2, arrival_timeout_s=1.0)
    assert "rank 1 never arrived at collective #2" in results[0]
    assert "its last: #1 all_reduce(float32[4]) at t.py:5 in f" in results[0]
