"""Parquet files and `datasets` save_to_disk directories as inputs of `meshrun data prepare`,
read with pyarrow (the `hf` extra) a record batch at a time.

A save_to_disk directory is read through its Arrow files, memory-mapped, as its state.json lists
them; a DatasetDict's (dataset_dict.json + one directory per split) split is chosen by `split`.
The `datasets` package itself is not needed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from meshrun.data.sources import Batch, Source, fields_hint, text_batches
from meshrun.errors import DataError
from meshrun.extras import import_extra

DEFAULT_SPLIT = "train"
_ARROW_ROWS = 1024  # rows per pyarrow record batch read from Parquet
_MAX_STATE_BYTES = 16 << 20


def _is_text(pa, arrow_type) -> bool:
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or (
        hasattr(pa.types, "is_string_view") and pa.types.is_string_view(arrow_type))


def _check_schema(pa, schema, text_field: str, where: str) -> None:
    if text_field not in schema.names:
        raise DataError(f"{where} has no field {text_field!r} {fields_hint(schema.names)}")
    arrow_type = schema.field(text_field).type
    if not _is_text(pa, arrow_type):
        texts = [f.name for f in schema if _is_text(pa, f.type)]
        raise DataError(f"{where}: field {text_field!r} holds {arrow_type}, not text; "
                        f"choose a text field with --text-field (text fields: {', '.join(texts) or 'none'})")


def check_record_fields(names: list[str], fields: tuple[str, ...], where: str) -> None:
    for name in fields:
        if name not in names:
            shown = ", ".join(repr(n) for n in names[:20]) or "none"
            raise DataError(f"{where} has no field {name!r} (its fields: {shown}); --format chat reads 'messages', "
                            "--format prompt-completion 'prompt' and 'completion'")


def _rows(record_batches, where: str) -> Iterator[tuple[str, dict]]:
    n = 0
    for batch in record_batches:
        for row in batch.to_pylist():
            yield f"{where} row {n}", row
            n += 1


class ParquetSource(Source):
    kind = "parquet"

    def _open(self):
        pa = import_extra("pyarrow", f"reading {self.path}", error=DataError)
        pq = import_extra("pyarrow.parquet", f"reading {self.path}", error=DataError)
        try:
            return pa, pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"cannot read {self.path} as Parquet ({exc})") from None

    def check(self, text_field: str) -> None:
        pa, pf = self._open()
        _check_schema(pa, pf.schema_arrow, text_field, str(self.path))

    def records(self, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
        """("FILE row N", {field: value}) of each row, for `data prepare --format chat|prompt-completion`."""
        _, pf = self._open()
        check_record_fields(pf.schema_arrow.names, fields, str(self.path))
        yield from _rows(pf.iter_batches(batch_size=_ARROW_ROWS, columns=list(fields)), str(self.path))

    def batches(self, source: int, text_field: str) -> Iterator[Batch]:
        _, pf = self._open()
        rows, total, size = 0, max(1, pf.metadata.num_rows), self.size()
        for record_batch in pf.iter_batches(batch_size=_ARROW_ROWS, columns=[text_field]):
            rows += record_batch.num_rows
            yield from text_batches(record_batch.column(0).to_pylist(), source, size * rows // total)


class ArrowDirSource(Source):
    """A directory from `Dataset.save_to_disk` (state.json + *.arrow), or from
    `DatasetDict.save_to_disk` (dataset_dict.json + one such directory per split)."""

    kind = "datasets"

    def __init__(self, path: Path, split: str | None):
        super().__init__(path)
        self.split = split or DEFAULT_SPLIT
        self.root = self._split_dir()
        self.files = self._data_files()

    def _json(self, path: Path) -> object:
        if path.stat().st_size > _MAX_STATE_BYTES:
            raise DataError(f"{path} is too large for a datasets index file; is {self.path} damaged?")
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataError(f"damaged datasets directory {self.path}: {path.name} is not valid JSON ({exc})") from None

    def _split_dir(self) -> Path:
        if (self.path / "state.json").is_file():
            return self.path
        if not (self.path / "dataset_dict.json").is_file():
            raise DataError(f"{self.path} is a directory but not one written by datasets' save_to_disk (no state.json "
                            "or dataset_dict.json); give files (.txt, .jsonl, .parquet) or such a directory")
        raw = self._json(self.path / "dataset_dict.json")
        splits = raw.get("splits") if isinstance(raw, dict) else None
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise DataError(f"damaged datasets directory {self.path}: dataset_dict.json lists no splits")
        if self.split not in splits:
            raise DataError(f"{self.path} has splits {', '.join(splits)}, not {self.split!r}; choose one with --split")
        return self.path / self.split

    def _data_files(self) -> list[Path]:
        state = self._json(self.root / "state.json")
        entries = state.get("_data_files") if isinstance(state, dict) else None
        names = [e.get("filename") for e in entries or [] if isinstance(e, dict)]
        bad = not names or any(not isinstance(n, str) or Path(n).name != n or n in ("", ".", "..") for n in names)
        if bad:  # a name must be a plain file name inside the directory: state.json is data
            raise DataError(f"damaged datasets directory {self.root}: state.json lists no usable data files")
        files = [self.root / n for n in names]
        for f in files:
            if not f.is_file():
                raise DataError(f"damaged datasets directory {self.root}: {f.name} is missing")
        return files

    def size(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def describe(self) -> dict:
        info = super().describe()
        return {**info, "split": self.split} if self.root != self.path else info

    def _pa(self):
        return import_extra("pyarrow", f"reading the datasets directory {self.path}", error=DataError)

    def _open_stream(self, pa, path: Path):
        source = pa.memory_map(str(path))
        try:
            return source, pa.ipc.open_stream(source)
        except pa.ArrowException as exc:
            raise DataError(f"damaged datasets directory {self.root}: {path.name} is not an Arrow stream ({exc})") from None

    def check(self, text_field: str) -> None:
        pa = self._pa()
        _, reader = self._open_stream(pa, self.files[0])
        _check_schema(pa, reader.schema, text_field, str(self.root))

    def records(self, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
        """("FILE row N", {field: value}) of each row of each Arrow file, in order."""
        pa = self._pa()
        for path in self.files:
            _, reader = self._open_stream(pa, path)
            check_record_fields(reader.schema.names, fields, f"{self.root} ({path.name})")
            yield from _rows(reader, str(path))

    def batches(self, source: int, text_field: str) -> Iterator[Batch]:
        pa = self._pa()
        before = 0
        for path in self.files:
            mapped, reader = self._open_stream(pa, path)
            _check_schema(pa, reader.schema, text_field, f"{self.root} ({path.name})")
            for record_batch in reader:
                texts = record_batch.column(text_field).to_pylist()
                yield from text_batches(texts, source, before + mapped.tell())
            before += path.stat().st_size
