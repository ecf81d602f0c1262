"""Failures explained in seconds: collective fingerprints, the hang watchdog, misuse checks.

Workers read their settings from the environment (`meshrun launch --debug collectives
--hang-timeout S` sets them); `meshrun.init()` installs what they ask for and `meshrun.shutdown()`
removes it. See docs/diagnose.md.
"""
