"""Files meshrun writes follow the user's umask, as `torch.save` and every Unix tool do.

Some writers create files 0600 whatever the umask says (`tempfile.mkstemp`, safetensors'
`save_file`); `follow_umask(path)` gives such a file the mode a plain `open(path, "w")` would have.
"""

from __future__ import annotations

import os


def current_umask() -> int:
    """The process's umask, read without changing it where the kernel reports it (Linux >= 4.7)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting it, then put it straight back
    os.umask(mask)
    return mask


def follow_umask(path: str | os.PathLike[str]) -> None:
    """Set path's mode to what `open(path, "w")` would have created: 0666 less the umask."""
    os.chmod(path, 0o666 & ~current_umask())
