"""The names the torchft mode's processes share: environment variables and files. (Its rules are
checked before launch by train/preflight.py.)"""

from __future__ import annotations

# Set by the launcher (launch.py) for every worker of a replica group; torchft reads the last two.
GROUP_ENV = "REPLICA_GROUP_ID"
NUM_GROUPS_ENV = "NUM_REPLICA_GROUPS"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
RECORDS_ENV = "MESHRUN_TORCHFT_DIR"  # where the groups write their ledgers and events
RECORDS_DIR = "torchft"  # <run dir>/torchft/
GROUP_DIR = "replica-{group}"  # group g > 0 trains in <run dir>/replica-g; group 0 in the run dir
