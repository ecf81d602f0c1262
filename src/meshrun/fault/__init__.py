"""`[fault] mode = "torchft"`: replica groups that keep training while a failed one heals from a peer.

    meshrun train --set fault.mode=torchft --set fault.replica_groups=2 --max-restarts 3

settings.py checks the config before anything starts (torch-free); launch.py hosts torchft's
lighthouse and runs one elastic agent per replica group; replica.py puts a worker's model,
optimizer and data under torchft's Manager; ledger.py records which data every committed step
consumed and checks that each sample was seen once. docs/fault-tolerance.md ("torchft mode").
"""
