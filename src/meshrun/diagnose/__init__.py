"""`meshrun diagnose`: a failed run's per-rank logs read after the fact, classified, with the fix."""
