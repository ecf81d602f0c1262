"""Failures explained in seconds: collective fingerprints, the hang watchdog, misuse checks.

Workers read their settings from the environment (`meshrun launch --debug collectives
--hang-timeout S` sets them); see docs/diagnose.md.
"""

from meshrun.debug.progress import heartbeat

__all__ = ["heartbeat"]
