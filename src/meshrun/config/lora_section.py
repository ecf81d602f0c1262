"""The `[lora]` section: low-rank adapters on a frozen base (meshrun.models.lora applies them through peft)."""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.config.base import Section, doc_field

# The attention and MLP projections of the built-in decoder and of Hugging Face Llama/Qwen2 models.
DEFAULT_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3",
                   "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSection(Section):
    """LoRA fine-tuning (Hu et al., arXiv:2106.09685) through peft: the base is frozen, only the adapters train."""

    section = "lora"
    rank: int = doc_field(0, "Rank of each adapter (peft's r); 0 = off, every weight trains (needs meshrun[lora] when > 0).")
    alpha: float = doc_field(16.0, "Scale numerator: an adapter's update is multiplied by alpha / rank.")
    dropout: float = doc_field(0.0, "Dropout on the adapters' input, in [0, 1).")
    targets: str = doc_field("", "Module names the adapters wrap (a name matches a module whose name ends with it, e.g. [\"wq\", \"wv\"]); '' = the attention and MLP projections of the built-in model and of Hugging Face Llama/Qwen2 models.", list_ok=True)

    def validate(self) -> None:
        self.at_least("rank", 0, " (0 = off)")
        self.require("alpha", self.alpha > 0, "> 0")
        self.require("dropout", 0 <= self.dropout < 1, "in [0, 1)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def target_names(self) -> tuple[str, ...]:
        """`targets` as names, or the default projections."""
        names = tuple(t.strip() for t in self.targets.split(",") if t.strip())
        return names or DEFAULT_TARGETS
