"""Sample text from a trained model in one process: a run, a checkpoint of any layout, or an HF directory.

Every source becomes a `transformers` causal LM in memory, so one sampling loop with transformers'
KV cache (`past_key_values`) serves the built-in decoder and HF models alike:
- an HF directory (config.json + safetensors) loads with `from_pretrained`;
- a run or checkpoint is read one tensor at a time (trained/model_source.py) and renamed by
  the export mapping (models/to_hf.py: the built-in decoder becomes a LlamaForCausalLM with
  its q/k rows permuted; a `[model] hf` run keeps its HF names); the model is built on the meta
  device and takes those tensors as they are (`assign=True`), so the weights are held once.

Sampling draws from a `torch.Generator` seeded by `seed`: the same seed gives the same text.
temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshrun.errors import ConfigError, shown

if TYPE_CHECKING:
    import torch

def need_transformers():
    """The transformers module, or one line naming the extra that installs it."""
    from meshrun.extras import import_extra

    return import_extra("transformers", "meshrun generate", error=ConfigError)


@dataclass
class Sampler:
    """What one sampling run draws with; validated here, each error naming its flag."""

    max_new_tokens: int = 100
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        checks = (("--max-new-tokens", self.max_new_tokens, self.max_new_tokens >= 1, "an integer >= 1"),
                  ("--temperature", self.temperature, self.temperature >= 0, "a number >= 0 (0 = greedy)"),
                  ("--top-k", self.top_k, self.top_k >= 0, "an integer >= 0 (0 = off)"),
                  ("--top-p", self.top_p, 0 < self.top_p <= 1, "a number in (0, 1] (1 = off)"),
                  ("--seed", self.seed, 0 <= self.seed < 2**63, "an integer >= 0"))
        for flag, value, ok, want in checks:
            if not ok or value != value:  # value != value: NaN
                raise ConfigError(f"{flag} {value}: give {want}")

    def pick(self, logits: torch.Tensor, gen: torch.Generator) -> int:
        """The next token id from one position's logits (vocab,)."""
        import torch

        if self.temperature == 0:
            return int(logits.argmax())
        logits = logits.float() / self.temperature
        if 0 < self.top_k < logits.numel():
            kth = torch.topk(logits, self.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1:
            sorted_p, order = probs.sort(descending=True)
            sorted_p[(sorted_p.cumsum(0) - sorted_p) >= self.top_p] = 0  # keep the smallest set reaching top_p
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=gen))


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    origin: str
    """What was loaded, for messages: the HF directory, checkpoint or model.pt."""
    max_positions: int | None
    tokenizer_dir: str = ""
    """The tokenizer's directory (its chat template, for --chat): the HF directory, or the run's data.tokenizer."""


def generate_ids(loaded: Loaded, prompt_ids: list[int], sampler: Sampler) -> list[int]:
    """New token ids after `prompt_ids`, until max_new_tokens, the end-of-text id or the model's last position."""
    import torch

    with torch.no_grad():
        return _sample(torch, loaded, prompt_ids, sampler)


def _sample(torch, loaded: Loaded, prompt_ids: list[int], sampler: Sampler) -> list[int]:
    gen = torch.Generator().manual_seed(sampler.seed)
    eos = getattr(loaded.tokenizer, "eos_id", None)
    limit = loaded.max_positions or (len(prompt_ids) + sampler.max_new_tokens)
    cache = _cache_kwargs(loaded.model)  # filled in place by each forward: only new tokens go in
    out = loaded.model(input_ids=torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1, **cache)
    new: list[int] = []
    for _ in range(sampler.max_new_tokens):
        token = sampler.pick(out.logits[0, -1], gen)
        if token == eos:
            break
        new.append(token)
        if len(prompt_ids) + len(new) >= limit:
            break
        out = loaded.model(input_ids=torch.tensor([[token]]), use_cache=True, logits_to_keep=1, **cache)
    return new


def _cache_kwargs(model: torch.nn.Module) -> dict:
    """A fresh KV cache, under the keyword this transformers version takes (5.24: `cache`)."""
    import inspect

    from transformers import DynamicCache

    params = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": DynamicCache(config=model.config)}


def generate_text(loaded: Loaded, prompt: str, sampler: Sampler, *, chat: bool = False) -> str:
    """The prompt followed by its sampled continuation. `chat`: the prompt is a user's message,
    rendered by the tokenizer directory's chat template up to the assistant's turn."""
    if chat:
        from meshrun.data.chat import ChatRenderer

        renderer = ChatRenderer(loaded.tokenizer_dir, loaded.tokenizer)
        prompt = renderer.prompt([{"role": "user", "content": prompt}], where="--chat")
    ids = loaded.tokenizer.encode(prompt)
    if not ids:
        eos = getattr(loaded.tokenizer, "eos_id", None)
        if eos is None:
            raise ConfigError("--prompt '': give a prompt (this tokenizer has no end-of-text token to start from)")
        ids = [eos]  # training data puts <eos> before each document: start one
    if loaded.max_positions and len(ids) >= loaded.max_positions:
        raise ConfigError(f"--prompt is {len(ids)} tokens; this model takes at most {loaded.max_positions - 1} "
                          "before its first new token: shorten it")
    return prompt + loaded.tokenizer.decode(generate_ids(loaded, ids, sampler))


def load(path: Path, adapter: Path | None = None) -> Loaded:
    """An HF directory, a run directory or a checkpoint directory, as a causal LM and its tokenizer.
    `adapter`: a peft adapter directory (`ckpt export --format peft`) merged into an HF directory's model."""
    from meshrun.checkpoint import manifest as mf
    from meshrun.rundir.runs import CONFIG_FILE

    path = Path(path)
    refused = mf.unusable(path)
    if refused:
        raise ConfigError(f"{shown(path)} is not a usable path ({refused}); give "
                          "a run directory (runs/NAME), a checkpoint or a Hugging Face model directory")
    if not path.exists():
        raise ConfigError(f"{path} does not exist; give a run directory (runs/NAME), a checkpoint "
                          "(runs/NAME/checkpoints/step-N) or a Hugging Face model directory")

    is_run = mf.is_checkpoint(path) or (path / CONFIG_FILE).is_file()
    if not is_run and not (path / "config.json").is_file():  # before the slow imports: bad input is quick
        raise ConfigError(f"{path} is neither a meshrun run directory ({CONFIG_FILE}), a checkpoint "
                          f"({mf.MANIFEST}) nor a Hugging Face model directory (config.json); give runs/NAME, "
                          "runs/NAME/checkpoints/step-N or an HF directory")
    if adapter is not None and is_run:
        raise ConfigError(f"--adapter {adapter}: give it with the Hugging Face base directory; {path} is a meshrun "
                          "run or checkpoint, whose LoRA adapters are merged in already")
    transformers = need_transformers()
    if is_run:
        return _load_run(transformers, path)
    loaded = _load_hf_dir(transformers, path)
    if adapter is not None:
        loaded.model = _with_adapter(loaded.model, Path(adapter))
    return loaded


def _with_adapter(model: torch.nn.Module, adapter: Path) -> torch.nn.Module:
    """`model` with the peft adapter directory merged in (peft's `merge_and_unload`)."""
    from meshrun.extras import import_extra

    peft = import_extra("peft", f"--adapter {adapter}", error=ConfigError)
    if not (adapter / "adapter_config.json").is_file():
        raise ConfigError(f"--adapter {adapter}: no adapter_config.json there; give a directory written by "
                          "`meshrun ckpt export CKPT --format peft` or peft's save_pretrained")
    return peft.PeftModel.from_pretrained(model, str(adapter), trust_remote_code=False).merge_and_unload().eval()


def _load_hf_dir(transformers, path: Path) -> Loaded:
    from meshrun.data.tokenizer import load_tokenizer

    if not (path / "tokenizer.json").is_file():
        raise ConfigError(f"{path} has no tokenizer.json; meshrun generate needs the model's tokenizer there")
    from meshrun.models.hf_load import check_hf_weights
    from meshrun.runtime.inputs import read_json

    config = read_json("model.hf", path / "config.json", fix="give the directory save_pretrained wrote")
    if not isinstance(config, dict):
        raise ConfigError(f"{path}/config.json holds {type(config).__name__}, not a JSON object")
    check_hf_weights(str(path))  # regular files, valid headers: a FIFO or a corrupt file is one line
    bar = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # stdout/stderr carry the text, not a loading bar
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - transformers and safetensors raise many types for a bad directory
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{path} does not load as a Hugging Face causal LM: {first}") from None
    finally:
        if bar:
            transformers.utils.logging.enable_progress_bar()
    model.eval()
    return Loaded(model, load_tokenizer(path), str(path), _max_positions(model.config), tokenizer_dir=str(path))


def _load_run(transformers, path: Path) -> Loaded:
    from meshrun.checkpoint.export_tokenizer import token_ids, tokenizer_spec
    from meshrun.data.tokenizer import load_tokenizer
    from meshrun.models.meta import on_meta
    from meshrun.models.to_hf import plan_for
    from meshrun.trained.model_source import open_source

    source = open_source(path)
    from meshrun.trained.lora import has_adapters, merged

    if has_adapters(source):  # a LoRA run: its base with the adapters merged in
        source = merged(source)
    plan = plan_for(source.specs, source.config, token_ids(source.config))
    tokenizer = load_tokenizer(tokenizer_spec(source.config))
    config = dict(plan.config)
    config_obj = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    with on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config_obj)
    state = {}
    for name, hf_name in plan.names.items():  # one tensor at a time: read, convert, keep
        state[hf_name] = plan.convert(name, source.read(name))
    model.load_state_dict(state, strict=False, assign=True)
    del state
    if getattr(config_obj, "tie_word_embeddings", False):
        model.tie_weights()
    _rebuild_buffers(model)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise ConfigError(f"{source.path}: the weights do not fill the model ({', '.join(left[:3])} missing)")
    model.eval()
    return Loaded(model, tokenizer, str(source.path), _max_positions(config_obj),
                  tokenizer_dir=tokenizer_spec(source.config))


def _rebuild_buffers(model: torch.nn.Module) -> None:
    """Derived buffers (rotary inv_freq) are never in a checkpoint: rebuild their modules on the CPU."""
    for owner_name, owner in list(model.named_modules()):
        if any(b.device.type == "meta" for b in owner.buffers(recurse=False)) and hasattr(owner, "config"):
            fresh = type(owner)(config=owner.config)
            parent_name, _, attr = owner_name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, fresh)


def _max_positions(config) -> int | None:
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None
