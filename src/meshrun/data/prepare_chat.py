"""`meshrun data prepare --format chat|prompt-completion`: records -> tokens.bin + loss_mask.bin + examples.bin.

    meta = prepare_examples(["chats.jsonl"], "data/chat", load_tokenizer("tok/"), records="chat",
                            tokenizer_dir="tok/", train_on="assistant", max_len=2048)

One example per record, in input order, each followed by the end-of-text id unless it already ends
with it (that id is trained when the example's last token is). Records too long for `max_len`, empty,
with an unknown role or (assistant-only) without an assistant turn are left out and counted in
meta.json's `skipped`, never truncated. Encoding runs in this process (the chat template is
rendered per turn); the format is meshrun.data.tokens' version 2.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import Counter
from pathlib import Path

from meshrun.data.chat import TRAIN_ON, ChatRenderer, Skip, check_messages, prompt_completion
from meshrun.data.encode import TYPECODES
from meshrun.data.prepare import abandon_tokens, check_out_dir, open_source
from meshrun.data.tokenizer import Tokenizer, tokenizer_fingerprint
from meshrun.data.tokens import (
    EXAMPLES_FILE,
    FORMAT_VERSION,
    LOSS_MASK_FILE,
    META_FILE,
    TOKENS_FILE,
    TokenMeta,
    dtype_for_vocab,
    meta_json,
    sample_sha256,
)
from meshrun.errors import DataError

RECORDS = {"chat": ("messages",), "prompt-completion": ("prompt", "completion")}


class _Writer:
    """tokens.bin / loss_mask.bin / examples.bin written side by side (as .tmp until `commit`)."""

    def __init__(self, out: Path, dtype: str):
        self.out, self.code = out, TYPECODES[dtype]
        self.paths = {name: out / (name + ".tmp") for name in (TOKENS_FILE, LOSS_MASK_FILE, EXAMPLES_FILE)}
        self.files = {name: p.open("wb") for name, p in self.paths.items()}
        self.sha = {name: hashlib.sha256() for name in self.paths}
        self.num_tokens = self.num_trained = self.num_examples = 0

    def _put(self, name: str, data: bytes) -> None:
        self.files[name].write(data)
        self.sha[name].update(data)

    def add(self, ids: list[int], mask: list[int]) -> None:
        self._put(EXAMPLES_FILE, array("q", [self.num_tokens]).tobytes())
        self._put(TOKENS_FILE, array(self.code, ids).tobytes())
        self._put(LOSS_MASK_FILE, bytes(mask))
        self.num_tokens += len(ids)
        self.num_trained += sum(mask)
        self.num_examples += 1

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def abandon(self, created: Path | None) -> None:
        self.close()
        for name in (LOSS_MASK_FILE, EXAMPLES_FILE):
            self.paths[name].unlink(missing_ok=True)
        abandon_tokens(self.paths[TOKENS_FILE], created)

    def commit(self) -> None:
        (self.out / META_FILE).unlink(missing_ok=True)  # no meta = not a usable directory, until the new one
        for name, p in self.paths.items():
            os.replace(p, self.out / name)


def prepare_examples(sources: list[str | Path], out_dir: str | Path, tokenizer: Tokenizer, *, records_kind: str,
                     tokenizer_dir: str | Path | None = None, train_on: str = "assistant",
                     max_len: int | None = None, val_fraction: float | None = None,
                     split: str | None = None) -> TokenMeta:
    """Tokenize chat or prompt-completion records of `sources` into out_dir (format version 2).

    records_kind: "chat" (records hold `messages`) or "prompt-completion" (`prompt`, `completion`).
    tokenizer_dir: the Hugging Face tokenizer directory whose chat template renders chats.
    train_on: "assistant" (assistant turns / the completion) or "prompt" (every token).
    max_len: records longer than this many tokens are left out and counted (None: no limit).
    """
    if records_kind not in RECORDS:
        raise DataError(f"--format must be text, chat or prompt-completion, got {records_kind!r}")
    if train_on not in TRAIN_ON:
        raise DataError(f"--train-on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
    if not sources:
        raise DataError("no input files; usage: meshrun data prepare FILE... --out DIR --format chat --tokenizer DIR")
    if val_fraction is not None and not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    renderer = ChatRenderer(tokenizer_dir or tokenizer.spec, tokenizer) if records_kind == "chat" else None
    out = Path(out_dir).expanduser()
    check_out_dir(out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    writer = _Writer(out, dtype)
    skipped: Counter = Counter()
    unknown_roles: Counter = Counter()
    described = []
    try:
        for path in sources:
            before = (writer.num_tokens, writer.num_examples)
            src = open_source(path, split=split)
            for where, record in src.records(RECORDS[records_kind]):
                try:
                    ids, mask = _example(record, where, tokenizer, renderer, train_on)
                    if max_len is not None and len(ids) > max_len:
                        raise Skip("too_long")
                except Skip as skip:
                    skipped[skip.reason] += 1
                    if skip.reason == "unknown_role":
                        unknown_roles[skip.detail] += 1
                    continue
                writer.add(ids, mask)
            described.append({**src.describe(), "num_tokens": writer.num_tokens - before[0],
                              "num_documents": writer.num_examples - before[1]})
        writer.close()
    except BaseException:
        writer.abandon(out if created else None)
        raise
    skipped_out = dict(skipped) | ({"unknown_roles": dict(unknown_roles)} if unknown_roles else {})
    if writer.num_trained == 0:
        writer.abandon(out if created else None)
        raise DataError(f"the inputs {[str(s) for s in sources]} give no trained token "
                        f"({summarize_skipped(skipped_out, max_len) or 'no records'} skipped); "
                        "give records with an assistant turn (or a completion)")
    writer.commit()
    meta = TokenMeta(dtype=dtype, num_tokens=writer.num_tokens, vocab_size=tokenizer.vocab_size,
                     tokenizer=tokenizer_fingerprint(tokenizer), sha256=writer.sha[TOKENS_FILE].hexdigest(),
                     sample_sha256=sample_sha256(out / TOKENS_FILE), sources=described, val_fraction=val_fraction,
                     version=FORMAT_VERSION, records=records_kind,
                     loss_mask={"file": LOSS_MASK_FILE, "sha256": writer.sha[LOSS_MASK_FILE].hexdigest(),
                                "num_trained": writer.num_trained, "train_on": train_on},
                     examples={"file": EXAMPLES_FILE, "sha256": writer.sha[EXAMPLES_FILE].hexdigest(),
                               "count": writer.num_examples, "max_len": max_len},
                     skipped=skipped_out)
    tmp_meta = out / (META_FILE + ".tmp")
    tmp_meta.write_text(meta_json(meta))
    os.replace(tmp_meta, out / META_FILE)
    return meta


def _example(record: dict, where: str, tokenizer: Tokenizer, renderer: ChatRenderer | None,
             train_on: str) -> tuple[list[int], list[int]]:
    if renderer is None:
        for name in RECORDS["prompt-completion"]:
            if name not in record:
                raise DataError(f"{where} has no field {name!r}; --format prompt-completion reads "
                                "{\"prompt\": ..., \"completion\": ...} records")
        return prompt_completion(tokenizer, record["prompt"], record["completion"], where=where, train_on=train_on)
    if "messages" not in record:
        raise DataError(f"{where} has no field 'messages' (its fields: {', '.join(map(repr, list(record)[:20]))}); "
                        "--format chat reads {\"messages\": [{\"role\": ..., \"content\": ...}, ...]} records")
    ids, mask = renderer.chat(check_messages(record["messages"], where), where=where, train_on=train_on)
    eos = tokenizer.eos_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids, mask = ids + [eos], mask + [mask[-1] if mask else 0]
    return ids, mask


_REASONS = {"too_long": "longer than --max-len {max_len}", "empty": "empty", "unknown_role": "with an unknown role",
            "no_assistant": "without an assistant turn"}


def summarize_skipped(skipped: dict, max_len: int | None) -> str:
    """'2 longer than --max-len 64, 1 empty' from meta.json's `skipped` ('' when none)."""
    parts = []
    for reason, text in _REASONS.items():
        if skipped.get(reason):
            roles = skipped.get("unknown_roles") if reason == "unknown_role" else None
            named = f" ({', '.join(map(repr, list(roles)[:5]))})" if roles else ""
            parts.append(f"{skipped[reason]} {text.format(max_len=max_len)}{named}")
    return ", ".join(parts)
