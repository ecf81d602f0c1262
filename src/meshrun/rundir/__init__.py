"""A run directory: its lock (one owner), its listing (finished, unfinished, continued) and its append-only history."""
