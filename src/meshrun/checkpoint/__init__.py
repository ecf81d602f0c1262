"""Distributed checkpoints through torch.distributed.checkpoint: save, commit, verify, resume, export."""

from meshrun.checkpoint.manager import Checkpointer, Preempted
from meshrun.checkpoint.manifest import CheckpointError

__all__ = ["CheckpointError", "Checkpointer", "Preempted"]
