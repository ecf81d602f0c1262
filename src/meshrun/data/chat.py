"""Chat and prompt-completion records to token ids plus a per-token loss mask (1 = trained).

    renderer = ChatRenderer("tok/", load_tokenizer("tok/"))        # the directory's own chat template
    ids, mask = renderer.chat(record["messages"], where="a.jsonl line 3", train_on="assistant")
    ids, mask = prompt_completion(tokenizer, "2+2=", "4", train_on="assistant")

The template is rendered by transformers' `apply_chat_template` (Jinja in a sandbox; the tokenizer
is loaded with trust_remote_code=False, so no code from the directory runs). The assistant spans:
- a template with `{% generation %}` blocks: transformers' own `return_assistant_tokens_mask`;
- any other: each assistant turn i spans from the rendering of messages[:i] with the generation
  prompt to the rendering of messages[:i+1], both of which must be token prefixes of the whole
  conversation's ids. A template for which that does not hold (one that rewrites earlier turns) is
  refused in one line naming the record, never guessed at.
A record that cannot be used as data varies (too long, empty, an unknown role) raises `Skip`,
which prepare counts; a malformed one (no messages list, a message without a role) a DataError.
"""

from __future__ import annotations

import re
from pathlib import Path

from meshrun.data.tokenizer import Tokenizer
from meshrun.errors import DataError
from meshrun.extras import import_extra

ROLES = ("system", "user", "assistant", "tool", "developer", "ipython", "function")
TRAIN_ON = ("assistant", "prompt")  # assistant: assistant turns / the completion only; prompt: every token
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class Skip(Exception):  # noqa: N818 -- a record left out, not an error
    """A record left out and counted: `reason` is a key of the summary ("empty", "unknown_role", ...)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def check_messages(messages: object, where: str) -> list[dict]:
    """The record's messages as [{role, content}], or a DataError (malformed) or Skip (empty, unknown role)."""
    if not isinstance(messages, list):
        raise DataError(f"{where}: 'messages' holds a {type(messages).__name__}, not a list of "
                        "{role, content} objects; fix the record or use --format text")
    out = []
    for n, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise DataError(f"{where}: message {n} is not an object with a 'role' string (found {str(msg)[:60]!r}); "
                            "each message is {\"role\": ..., \"content\": ...}")
        content = msg.get("content")
        if content is not None and not isinstance(content, str):
            raise DataError(f"{where}: message {n}'s content is a {type(content).__name__}, not text; "
                            "only text conversations are read")
        if msg["role"] not in ROLES:
            raise Skip("unknown_role", msg["role"])
        out.append({**msg, "content": content or ""})  # other keys (name, tool_calls) go to the template too
    if not any(m["content"].strip() for m in out):
        raise Skip("empty")
    return out


def prompt_completion(tokenizer: Tokenizer, prompt: object, completion: object, *, where: str,
                      train_on: str) -> tuple[list[int], list[int]]:
    """prompt ids then completion ids and the end-of-text id; the mask covers the completion and eos
    (every token under train_on="prompt")."""
    for name, value in (("prompt", prompt), ("completion", completion)):
        if value is not None and not isinstance(value, str):
            raise DataError(f"{where}: field {name!r} holds a {type(value).__name__}, not text")
    if not completion or not str(completion).strip():
        raise Skip("empty")
    p = tokenizer.encode(prompt or "")
    c = tokenizer.encode(completion) + ([] if tokenizer.eos_id is None else [tokenizer.eos_id])
    return p + c, [1 if train_on == "prompt" else 0] * len(p) + [1] * len(c)


class ChatRenderer:
    """A tokenizer directory's chat template, through transformers (loaded once, no remote code)."""

    def __init__(self, directory: str | Path, tokenizer: Tokenizer):
        directory = Path(directory).expanduser()
        if not directory.is_dir():
            raise DataError(f"--format chat needs --tokenizer to be a Hugging Face tokenizer directory with a chat "
                            f"template, got {str(directory)!r}")
        transformers = import_extra("transformers", "--format chat", error=DataError)
        try:
            self._hf = transformers.AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False,
                                                                  local_files_only=True)
        except Exception as exc:  # noqa: BLE001 -- transformers raises many kinds; all mean "not loadable"
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise DataError(f"--tokenizer {directory}: transformers cannot load it without remote code "
                            f"({first[:200]}); give a directory saved by save_pretrained") from None
        template = getattr(self._hf, "chat_template", None)
        if not template:
            raise DataError(f"--tokenizer {directory} has no chat template (tokenizer_config.json 'chat_template' "
                            "or chat_template.jinja); add one, or use --format prompt-completion")
        self.tokenizer = tokenizer
        self.generation_blocks = bool(_GENERATION_TAG.search(str(template)))

    def _render(self, messages: list[dict], *, generation_prompt: bool, where: str) -> str:
        try:
            return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as exc:  # noqa: BLE001 -- a template's raise_exception, or a Jinja error
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise DataError(f"{where}: the chat template refuses the conversation ({first[:200]})") from None

    def prompt(self, messages: list[dict], *, where: str) -> str:
        """The conversation rendered up to the assistant's next turn (`meshrun generate --chat`)."""
        return self._render(messages, generation_prompt=True, where=where)

    def chat(self, messages: list[dict], *, where: str, train_on: str) -> tuple[list[int], list[int]]:
        """(ids, mask) of one conversation: mask 1 on assistant turns (every token under train_on="prompt")."""
        if train_on == "assistant" and not any(m["role"] == "assistant" and m["content"] for m in messages):
            raise Skip("no_assistant")
        if self.generation_blocks:
            out = self._hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
            ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        else:
            ids = self.tokenizer.encode(self._render(messages, generation_prompt=False, where=where))
            mask = [0] * len(ids)
            for i, msg in enumerate(messages):
                if msg["role"] == "assistant":
                    start = self._prefix_len(messages[:i], ids, generation_prompt=True, where=where)
                    end = self._prefix_len(messages[:i + 1], ids, generation_prompt=False, where=where)
                    mask[start:end] = [1] * (end - start)
        if train_on == "prompt":
            mask = [1] * len(ids)
        return ids, mask

    def _prefix_len(self, messages: list[dict], ids: list[int], *, generation_prompt: bool, where: str) -> int:
        prefix = self.tokenizer.encode(self._render(messages, generation_prompt=generation_prompt, where=where)) \
            if messages or generation_prompt else []
        if ids[:len(prefix)] != prefix:
            raise DataError(f"{where}: this chat template does not render the first {len(messages)} message(s) "
                            "as a prefix of the whole conversation, so the assistant turns cannot be found; "
                            "use a template with {% generation %} blocks, or --train-on prompt")
        return len(prefix)
