"""Optional dependencies: import one, or say in one line which extra installs it.

    pq = import_extra("pyarrow.parquet", "reading data.parquet", error=DataError)
"""

from __future__ import annotations

import importlib
from types import ModuleType

from meshrun.errors import MeshrunError

HF_EXTRA = "meshrun[hf]"
# The extra that provides each optional top-level package.
EXTRA_OF = {"pyarrow": HF_EXTRA, "accelerate": HF_EXTRA, "datasets": HF_EXTRA, "tokenizers": HF_EXTRA, "transformers": HF_EXTRA,
            "safetensors": HF_EXTRA, "tensorboard": "meshrun[tensorboard]", "mlflow": "meshrun[mlflow]",
            "wandb": "meshrun[wandb]", "trackio": "meshrun[trackio]",
            "torchft": "meshrun[torchft]", "yaml": "meshrun[kubernetes]", "ray": "meshrun[ray]",
            "peft": "meshrun[lora]"}


def missing_extra_message(module: str, purpose: str) -> str:
    """`"{purpose} needs pyarrow: pip install 'meshrun[hf]'"` (the one wording of this message)."""
    top = module.split(".")[0]
    return f"{purpose} needs {top}: pip install '{EXTRA_OF.get(top, HF_EXTRA)}'"


def import_extra(module: str, purpose: str, *, error: type[MeshrunError] = MeshrunError) -> ModuleType:
    """`importlib.import_module(module)`, or `error` with `missing_extra_message` when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise error(missing_extra_message(module, purpose)) from None
