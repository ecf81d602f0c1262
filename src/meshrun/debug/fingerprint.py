"""`--debug collectives`: every rank compares each collective with its peers' before running it.

Each rank writes the fingerprint of its Nth collective on a group (op, group, dtype and shape,
file:line) under `fp/<group>/<N>/<rank>` in the job's store, then waits for its peers' Nth.
Different ops, dtypes or shapes stop the job at once, naming the rank that diverged (the
minority; with two ranks, the one whose call site its peer never used: the extra call). A peer
that finished (`done/<rank>`) or does not arrive within the arrival timeout is reported too:
the case torch's TORCH_DISTRIBUTED_DEBUG=DETAIL cannot see, since it needs every rank to call.
Call sites may differ legitimately (`if rank == 0: broadcast(x) else: broadcast(y)`), so they
alone do not stop the job; the first divergence of sites is named in any later report.
"""

from __future__ import annotations

import json
import time
from collections import Counter

from meshrun.debug.heartbeat import CollectiveRecord
from meshrun.debug.indirect import bucket_hint


class CollectiveMismatchError(RuntimeError):
    """Ranks disagree on a collective: raised on the detecting ranks, recorded in error.json."""

    meshrun_diagnosis = True  # the launch bootstrap prints only the user's frames


def _fp(record: CollectiveRecord, rank: int) -> dict:
    return {"rank": rank, "seq": record.seq, "op": record.op, "group": record.group,
            "tensors": record.tensors, "site": record.site}


def _call(fp: dict) -> str:
    return f"{fp['op']}({fp['tensors']}) at {fp['site']}"


class Checker:
    """Fingerprint comparison for one worker, over its own store connection."""

    def __init__(self, store, rank: int, world_size: int, arrival_timeout_s: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.arrival_timeout_s = arrival_timeout_s
        self.sites: set[str] = set()
        self.site_divergence: str | None = None
        self.last_seq: dict[str, int] = {}

    def _ranks(self, group) -> list[int]:
        if group is None:
            return list(range(self.world_size))
        import torch.distributed as dist

        return list(dist.get_process_group_ranks(group))

    def check(self, record: CollectiveRecord, group) -> None:
        ranks = self._ranks(group)
        if len(ranks) < 2 or self.rank not in ranks:
            return
        mine = _fp(record, self.rank)
        base = f"fp/{record.group}/{record.seq}/"
        self.store.set(base + str(self.rank), json.dumps(mine))
        self.last_seq[record.group] = record.seq
        if record.site not in self.sites:
            self.sites.add(record.site)
            self.store.set(f"sites/{self.rank}", json.dumps(sorted(self.sites)))
        peers = [r for r in ranks if r != self.rank]
        self._await(peers, base, mine)
        fps = [json.loads(v) for v in self.store.multi_get([base + str(r) for r in ranks])]
        self._compare(fps, mine)
        if record.seq > 2:  # every peer has read seq-2 by now: each rank waits for all at every seq
            try:
                self.store.delete_key(f"fp/{record.group}/{record.seq - 2}/{self.rank}")
            except Exception:  # noqa: BLE001
                pass

    def _await(self, peers: list[int], base: str, mine: dict) -> None:
        start = time.monotonic()
        pause = 0.0002
        keys = [base + str(r) for r in peers]
        while not self.store.check(keys):
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            if pause < 0.05:
                continue
            missing = [r for r in peers if not self.store.check([base + str(r)])]
            for peer in missing:
                done = self._done(peer)
                if done is not None:
                    self._fail_finished(peer, done, mine)
            if time.monotonic() - start > self.arrival_timeout_s:
                self._fail_absent(missing, mine, time.monotonic() - start)

    def _done(self, peer: int) -> dict | None:
        if not self.store.check([f"done/{peer}"]):
            return None
        return json.loads(self.store.get(f"done/{peer}"))

    def _peer_sites(self, peer: int) -> set[str]:
        if not self.store.check([f"sites/{peer}"]):
            return set()
        return set(json.loads(self.store.get(f"sites/{peer}")))

    def _last_of(self, peer: int, group: str, seq: int) -> str:
        key = f"fp/{group}/{seq}/{peer}"
        if seq < 1 or not self.store.check([key]):
            return "none"
        return _call(json.loads(self.store.get(key)))

    def _compare(self, fps: list[dict], mine: dict) -> None:
        def sig(fp):
            return (fp["op"], fp["tensors"])

        counts = Counter(sig(fp) for fp in fps)
        if len(counts) == 1:
            if len({fp["site"] for fp in fps}) > 1 and self.site_divergence is None:
                self.site_divergence = self._describe_site_divergence(fps, mine)
            return
        diverging = self._diverging(fps, counts, sig)
        lines = [f"rank {fp['rank']}: {_call(fp)}" for fp in fps]
        who = ", ".join(str(r) for r in diverging)
        head = (f"collective mismatch at #{mine['seq']} on group {mine['group']}: rank {who} diverged "
                f"({'; '.join(lines)})")
        hint = bucket_hint([fp["site"] for fp in fps])
        if hint:
            head = f"{head}; {hint}"
        self._raise(head, diverging)

    def _describe_site_divergence(self, fps: list[dict], mine: dict) -> str:
        """Name the call that no peer ever made from that line: the likely extra collective."""
        extra = [fp for fp in fps
                 if all(fp["site"] not in self._peer_sites(o["rank"]) for o in fps if o["rank"] != fp["rank"])]
        if len(extra) == 1:
            fp = extra[0]
            others = ", ".join(str(o["rank"]) for o in fps if o is not fp)
            return (f"rank {fp['rank']} diverged first: its #{fp['seq']} {_call(fp)} is from a line rank "
                    f"{others} never calls a collective from (an extra call, or one the others skip)")
        return f"call sites first differed at #{mine['seq']} on group {mine['group']}: " + "; ".join(
            f"rank {fp['rank']} {fp['site']}" for fp in fps)

    def _diverging(self, fps: list[dict], counts: Counter, sig) -> list[int]:
        top = counts.most_common()
        if top[0][1] > top[1][1]:  # a majority: everyone else diverged
            return sorted(fp["rank"] for fp in fps if sig(fp) != top[0][0])
        # a tie (two ranks): the rank calling from a line its peers never used made the extra call
        extra = [fp["rank"] for fp in fps
                 if all(fp["site"] not in self._peer_sites(o["rank"]) for o in fps if o["rank"] != fp["rank"])]
        return sorted(extra) if 0 < len(extra) < len(fps) else sorted(fp["rank"] for fp in fps)

    def _fail_finished(self, peer: int, done: dict, mine: dict) -> None:
        their = int(done.get(mine["group"], 0))
        head = (f"collective mismatch: rank {self.rank} diverged: it made more collectives than rank {peer}, "
                f"which finished after {their} on group {mine['group']} while rank {self.rank} waits at "
                f"#{mine['seq']} {_call(mine)}")
        self._raise(head, [self.rank])

    def _fail_absent(self, missing: list[int], mine: dict, waited: float) -> None:
        parts = []
        for peer in missing:
            prev = self._last_of(peer, mine["group"], mine["seq"] - 1)
            parts.append(f"rank {peer} (its last: #{mine['seq'] - 1} {prev})")
        head = (f"collective mismatch: rank {', '.join(str(r) for r in missing)} never arrived at collective "
                f"#{mine['seq']} on group {mine['group']} within {waited:.0f}s, where rank {self.rank} waits at "
                f"{_call(mine)}; {', '.join(parts)}")
        self._raise(head, missing)

    def _raise(self, head: str, diverging: list[int]) -> None:
        if self.site_divergence:  # the origin leads; what it led to follows
            head = f"collective mismatch: {self.site_divergence}; then: {head.removeprefix('collective mismatch: ')}"
        raise CollectiveMismatchError(head)

    def mark_done(self) -> None:
        """Tell peers this rank has made its last collective (called at shutdown and exit)."""
        try:
            self.store.set(f"done/{self.rank}", json.dumps(self.last_seq))
        except Exception:  # noqa: BLE001 - the store may be gone at exit
            pass
