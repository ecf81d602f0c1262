"""Parallelism: functions that wrap a model for the current world; `parallelize()` fixes the order."""

from meshrun.parallel.parallelize import parallelize, unwrap_model

__all__ = ["parallelize", "unwrap_model"]
