"""How many tokens train and evaluation get, and the one message when the data is too small.

Torch-free, so `meshrun train` can check a token file's size before any worker starts.
"""

from __future__ import annotations

import math

from meshrun.errors import DataError


def split_sizes(n: int, val_fraction: float, seq_len: int) -> tuple[int, int]:
    """(train tokens, held-out tokens) of n tokens; DataError with advice that fits the numbers."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    window = seq_len + 1
    n_val = round(n * val_fraction)
    if val_fraction > 0 and (n_val < window or n - n_val < window):
        if n < 2 * window:  # no fraction gives both a window: say what would
            shorter = f"data.seq_len={n // 2 - 1} or less, " if n // 2 - 1 >= 1 else ""
            raise DataError(f"the data has {n} tokens: training and evaluation each need one window of "
                            f"data.seq_len + 1 = {window} tokens ({2 * window} in all); use more data, "
                            f"{shorter}or data.val_fraction=0 to train without evaluation")
        low = math.ceil(window / n * 1000) / 1000  # n * low >= window, so round(n * low) >= window
        high = math.floor((n - window) / n * 1000) / 1000
        raise DataError(f"data.val_fraction={val_fraction} holds out {n_val} of {n} tokens, leaving "
                        f"{n - n_val} to train; each side needs one window of data.seq_len + 1 = "
                        f"{window} tokens: use data.val_fraction between {low:g} and {high:g}, "
                        "or 0 to train without evaluation")
    if n - n_val < window:
        raise DataError(f"the data has {n} tokens, fewer than one window of data.seq_len + 1 = {window}; "
                        f"use more data{f' or data.seq_len={n - 1} or less' if n > 1 else ''}")
    return n - n_val, n_val
