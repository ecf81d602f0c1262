"""The `[fault]` section: what a worker failure does (meshrun.fault runs the torchft mode)."""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.config.base import Section, doc_field

TORCHFT = "torchft"
FAULT_MODES = ("exact", TORCHFT)  # fault.mode


@dataclass(frozen=True)
class FaultSection(Section):
    """What a worker failure does: 'exact' restarts every worker from the last state, 'torchft' keeps the survivors stepping."""

    section = "fault"
    mode: str = doc_field("exact", "'exact' = any failure restarts every worker, which resume bitwise from a snapshot or checkpoint; 'torchft' = replica groups under torchft's lighthouse: survivors keep stepping, a restarted group heals from a peer (needs meshrun[torchft]; docs/fault-tolerance.md).")
    replica_groups: int = doc_field(2, "torchft: replica groups (data-parallel copies of the model, each restarted on its own).")
    group_size: int = doc_field(1, "torchft: worker processes per replica group (the launch's --nproc-per-node is not used in this mode).")
    min_replicas: int = doc_field(1, "torchft: replica groups that must be in a quorum for a step to commit, <= replica_groups.")
    heartbeat_timeout_ms: int = doc_field(1000, "torchft: the lighthouse drops a group it has not heard from for this long; the survivors stall about this long after a failure.")
    join_timeout_ms: int = doc_field(5000, "torchft: how long the lighthouse waits for missing groups before it forms a quorum without them (at start and after a change).")
    timeout_s: float = doc_field(30.0, "torchft: limit for one cross-group all-reduce, commit vote or peer-state transfer; a step that exceeds it is not committed.")
    quorum_timeout_s: float = doc_field(60.0, "torchft: limit for forming a quorum at the start of a step.")

    def validate(self) -> None:
        self.one_of("mode", FAULT_MODES)
        self.at_least("replica_groups", 1)
        self.at_least("group_size", 1)
        self.at_least("min_replicas", 1)
        self.require("min_replicas", self.min_replicas <= self.replica_groups,
                     f"<= fault.replica_groups ({self.replica_groups})")
        for name in ("heartbeat_timeout_ms", "join_timeout_ms"):
            self.at_least(name, 1)
        for name in ("timeout_s", "quorum_timeout_s"):
            self.require(name, getattr(self, name) > 0, "> 0 seconds")


def is_torchft(cfg) -> bool:
    """Whether a JobConfig runs replica groups under torchft (meshrun.fault)."""
    return cfg.fault.mode == TORCHFT
