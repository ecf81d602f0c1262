"""Worker entry of `[fault] mode = "torchft"`: `meshrun train`'s worker, stepping as a replica group.

    meshrun launch --nproc-per-node 1 -m meshrun.fault.worker --run-dir runs/NAME/replica-1

meshrun.fault.launch starts every replica group's workers with this target. It is the train
worker (meshrun.train.worker) with torchft's step source: the trainer's loop asks the Replica
(replica.py) which steps to run and what ends each one, through train/trainer.py's StepSource.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from meshrun.fault.replica import attach
    from meshrun.train.worker import main as train_worker

    return train_worker(argv, steps=attach)


if __name__ == "__main__":
    sys.exit(main())
