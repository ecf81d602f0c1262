"""Distributed checkpoints through torch.distributed.checkpoint: save, commit, verify, resume, export."""

from meshrun.checkpoint.manager import Checkpointer
from meshrun.checkpoint.manifest import CheckpointError
from meshrun.checkpoint.preemption import Preempted

__all__ = ["CheckpointError", "Checkpointer", "Preempted"]
