"""The built-in training text, shipped inside the package: no download for the default run.

corpus.txt.gz holds about 0.8 MB of English prose from the docstrings of Python's standard
library (PSF License; see README.md here). Rebuild it with build_corpus.py in this folder.
"""

from __future__ import annotations

import functools
import gzip
from importlib import resources
from pathlib import Path

from meshrun.errors import DataError

CORPUS_FILE = "corpus.txt.gz"


def corpus_path() -> Path:
    """Where the installed corpus file is; a DataError if the install lacks it."""
    path = Path(str(resources.files(__name__) / CORPUS_FILE))
    if not path.is_file():
        raise DataError(f"the built-in corpus {path} is missing from this meshrun install; reinstall "
                        "meshrun, or set data.path to a text file or a prepared token directory")
    return path


@functools.lru_cache(maxsize=1)
def load_corpus_text() -> str:
    """The whole corpus as one string (cached: it is small)."""
    path = corpus_path()
    try:
        return gzip.decompress(path.read_bytes()).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise DataError(f"the built-in corpus {path} is damaged ({exc}); reinstall meshrun") from None
