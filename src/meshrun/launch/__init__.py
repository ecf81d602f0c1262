"""Launching workers: torchrun's elastic agent underneath, with meshrun's defaults and reports."""
