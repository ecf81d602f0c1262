"""Kept for imports written before TrainState moved: it lives in meshrun.checkpoint.state."""

from meshrun.checkpoint.state import TrainState

__all__ = ["TrainState"]
