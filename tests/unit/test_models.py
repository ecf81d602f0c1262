"""The built-in decoder, its named sizes and the model.factory plug-in (one process, CPU)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from meshrun.errors import ModelError
from meshrun.models import (
    SIZES,
    ModelArgs,
    ModelProtocol,
    Transformer,
    build_model,
    flops_per_token,
    get_size,
    model_args_from_config,
    num_params,
)

SMALL = dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32)


def model(**kw) -> Transformer:
    return Transformer(ModelArgs(**{**SMALL, **kw}), seed=0)


def tokens(b: int = 2, t: int = 16, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(1))


def cfg(**kw) -> SimpleNamespace:
    """A stand-in for the [model] config section: only some attributes, as a user might pass."""
    return SimpleNamespace(**kw)


# --- ModelArgs ---------------------------------------------------------------------------------


def test_args_auto_fields():
    args = ModelArgs(vocab_size=10, dim=128, n_layers=1, n_heads=4)
    assert args.n_kv_heads == 4  # 0 = MHA
    assert args.ffn_hidden == 384  # 2/3 * 512 = 341 -> next multiple of 64
    assert ModelArgs(vocab_size=10, dim=4096, n_layers=1, n_heads=32).ffn_hidden == 10944


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(n_heads=8, n_kv_heads=3, dim=64), "model.n_kv_heads=3 must divide model.n_heads=8"),
        (dict(dim=30, n_heads=4), "model.dim=30 must be divisible by model.n_heads=4"),
        (dict(dim=36, n_heads=4, n_kv_heads=0), "must be even for RoPE"),
        (dict(n_layers=0), "model.n_layers must be an integer > 0, got 0"),
        (dict(vocab_size=-1), "model.vocab_size must be an integer > 0"),
        (dict(ffn_hidden=-5), "model.ffn_hidden must be an integer >= 0"),
        (dict(rope_theta=0.0), "model.rope_theta must be a number > 0"),
        (dict(tie_embeddings="yes"), "model.tie_embeddings must be true or false"),
    ],
)
def test_args_validation(kw, message):
    with pytest.raises(ModelError, match=message.replace("(", r"\(")) as info:
        ModelArgs(**{**SMALL, **kw})
    assert "\n" not in str(info.value)


# --- forward -----------------------------------------------------------------------------------


def test_output_shape_and_dtype():
    m = model()
    x = tokens()
    logits = m(x)
    assert logits.shape == (2, 16, 64) and logits.dtype == torch.float32
    assert m.to(torch.float64)(x).dtype == torch.float64
    assert m.freqs_cos.dtype == torch.float32  # RoPE tables stay float32 under .to(dtype)


def test_causal():
    m = model()
    x = tokens()
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 64
    a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gqa_and_mha_shapes():
    gqa, mha = model(n_kv_heads=1), model(n_kv_heads=4)
    assert gqa.layers["0"].attention.wk.weight.shape == (8, 32)
    assert mha.layers["0"].attention.wk.weight.shape == (32, 32)
    assert gqa(tokens()).shape == mha(tokens()).shape
    assert num_params(gqa) < num_params(mha)


def test_rope_is_relative():
    """Attention scores depend on relative position only: a prefix shift leaves them equal."""
    from meshrun.models.llama import apply_rope, rope_tables

    cos, sin = rope_tables(8, 16, 10000.0)
    q = torch.randn(1, 1, 1, 8).expand(1, 16, 1, 8)
    k = torch.randn(1, 1, 1, 8).expand(1, 16, 1, 8)
    rq, rk = apply_rope(q, cos, sin)[0, :, 0], apply_rope(k, cos, sin)[0, :, 0]
    torch.testing.assert_close(rq[3] @ rk[1], rq[9] @ rk[7])


def test_seq_longer_than_max_is_a_model_error():
    with pytest.raises(ModelError, match="exceeds model.max_seq_len=32"):
        model()(tokens(t=33))


def test_tied_embeddings_share_storage():
    m = model(tie_embeddings=True)
    assert m.output.weight is m.tok_embeddings.weight
    assert m.output.weight.data_ptr() == m.tok_embeddings.weight.data_ptr()
    assert num_params(m) == num_params(model()) - 64 * 32
    assert "output.weight" not in dict(m.named_parameters())


def test_module_names_for_parallel_plans():
    names = {n for n, _ in model().named_parameters()}
    for i in range(3):
        for sub in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
                    "attention_norm", "ffn_norm"):  # fmt: skip
            assert f"layers.{i}.{sub}.weight" in names
    assert {"tok_embeddings.weight", "norm.weight", "output.weight"} <= names
    assert isinstance(model().layers, nn.ModuleDict)
    assert not any(n.endswith("bias") for n in names)
    assert "freqs_cos" not in model().state_dict()  # non-persistent: not in checkpoints


def test_pipeline_stage_style_pieces():
    """Stages as PP builds them: first (embed + blocks 0-1), last (block 2 + norm + output)."""
    full = model()
    x = tokens()
    first, last = model(), model()
    del first.layers["2"]
    first.norm, first.output = None, None
    del last.layers["0"], last.layers["1"]
    last.tok_embeddings = None
    h = first(x)
    assert h.shape == (2, 16, 32)
    torch.testing.assert_close(last(h), full(x))
    # Each stage's own init matches the full model's weights of the same name.
    last.init_weights(seed=0)
    full_sd = full.state_dict()
    for name, tensor in last.state_dict().items():
        torch.testing.assert_close(tensor, full_sd[name], msg=name)


# --- init --------------------------------------------------------------------------------------


def test_init_deterministic_with_seed():
    a, b, c = model(), model(), Transformer(ModelArgs(**SMALL), seed=1)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    torch.manual_seed(5)
    d = Transformer(ModelArgs(**SMALL))
    torch.manual_seed(5)
    e = Transformer(ModelArgs(**SMALL))
    assert torch.equal(d.layers["0"].attention.wq.weight, e.layers["0"].attention.wq.weight)


def test_init_scales():
    m = Transformer(ModelArgs(**{**SMALL, "dim": 256, "n_layers": 4, "n_heads": 4}), seed=0)
    assert m.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    wo = [m.layers[str(i)].attention.wo.weight.std().item() for i in range(4)]
    for i, s in enumerate(wo):
        assert s == pytest.approx(0.02 / math.sqrt(2 * (i + 1)), rel=0.05)
    assert torch.equal(m.norm.weight, torch.ones(256))
    assert m.tok_embeddings.weight.abs().max() <= 3 * 0.02 + 1e-6  # truncated at 3 std


def test_meta_build_then_materialise():
    with torch.device("meta"):
        m = Transformer(ModelArgs(**SMALL))
    assert m.layers["0"].attention.wq.weight.is_meta
    m.to_empty(device="cpu")
    m.init_weights(seed=0)
    torch.testing.assert_close(m(tokens()), model()(tokens()))


def test_on_meta_builds_the_same_model_without_running_fills():
    import subprocess
    import sys

    from meshrun.models.meta import on_meta

    with on_meta():
        m = Transformer(ModelArgs(**SMALL))
        drawn = nn.init.normal_(torch.empty(3))  # a fill on meta: returned as it is
    assert drawn.is_meta and all(t.is_meta for t in [*m.parameters(), *m.buffers()])
    m.to_empty(device="cpu")
    m.init_weights(seed=0)
    torch.testing.assert_close(m(tokens()), model()(tokens()))
    # the point of it: a shapes-only build (the launcher's memory check) never imports torch._dynamo
    code = ("import sys, torch; from meshrun.models.meta import on_meta; from meshrun.models import Transformer, "
            f"ModelArgs\nwith on_meta(): Transformer(ModelArgs(**{SMALL!r}))\nprint('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_initial_loss_near_uniform():
    m = model()
    x = tokens()
    loss = nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())
    assert abs(loss.item() - math.log(64)) < 0.2


# --- sizes, params and FLOPs -------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SIZES))
def test_every_size_builds_on_meta(name):
    args = get_size(name)
    with torch.device("meta"):
        m = Transformer(args)
    assert num_params(m) == args.num_params()
    assert num_params(m, exclude_embeddings=True) == args.num_params(exclude_embeddings=True)


def test_size_param_counts():
    assert 0.7e6 < get_size("tiny").num_params() < 1.2e6
    assert 10e6 < get_size("small").num_params() < 20e6
    assert 110e6 < get_size("base").num_params() < 140e6
    assert get_size("1b").num_params() == pytest.approx(1.236e9, rel=0.01)  # Llama-3.2-1B
    assert get_size("8b").num_params() == pytest.approx(8.03e9, rel=0.01)  # Llama-3-8B
    assert get_size("70b").num_params() == pytest.approx(70.55e9, rel=0.01)  # Llama-3.1-70B


def test_unknown_size_suggests():
    with pytest.raises(ModelError, match=r"model.name='tiy' .*did you mean 'tiny'.*valid: tiny"):
        get_size("tiy")
    assert get_size("8B").dim == 4096


def test_flops_per_token():
    args = ModelArgs(vocab_size=100, dim=64, n_layers=2, n_heads=4)
    n_matmul = 2 * (4 * 64 * 64 + 3 * 64 * 192 + 2 * 64) + 64 + 100 * 64  # blocks, norms, output
    assert flops_per_token(args, 32) == 6 * n_matmul + 12 * 2 * 4 * 16 * 32
    tied = ModelArgs(vocab_size=100, dim=64, n_layers=2, n_heads=4, tie_embeddings=True)
    assert flops_per_token(tied, 32) == flops_per_token(args, 32)  # output matmul still runs
    # Llama-3-8B at 8k: ~6*7.5e9 + attention, the known ~5e10 per token.
    assert 4.5e10 < flops_per_token(get_size("8b"), 8192) < 6e10


# --- build_model from a config -----------------------------------------------------------------


def test_build_model_defaults_and_overrides():
    m = build_model(cfg(name="tiny", factory="", dim=0, n_layers=2, tie_embeddings=None), 300)
    assert isinstance(m, Transformer)
    assert m.args.vocab_size == 300 and m.args.n_layers == 2 and m.args.dim == 128
    assert m.args.ffn_hidden == 384  # auto, from the size's dim
    assert build_model(cfg(), None).args == get_size("tiny")  # nothing set: the default size
    args = model_args_from_config(cfg(name="tiny", dim=256, vocab_size=512), 300)
    assert args.vocab_size == 512 and args.ffn_hidden == 704  # ffn follows the overridden dim
    assert model_args_from_config(cfg(name="1b", tie_embeddings=False), 300).tie_embeddings is False


def test_build_model_errors():
    with pytest.raises(ModelError, match="model.vocab_size=100 is smaller than the tokenizer"):
        model_args_from_config(cfg(vocab_size=100), 260)
    with pytest.raises(ModelError, match="model.name='huge' is not a known model size"):
        build_model(cfg(name="huge"), 260)
    with pytest.raises(ModelError, match="model.n_kv_heads=3 must divide model.n_heads=4"):
        build_model(cfg(n_kv_heads=3), 260)


USER_MODULE = """
import torch
from torch import nn

class Bigram(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.emb = nn.Embedding(vocab, vocab)
    def forward(self, tokens):
        return self.emb(tokens)

def build(model_cfg, vocab_size):
    return Bigram(vocab_size)

def build_noargs():
    return Bigram(7)

def build_bad():
    return "not a model"

NOT_CALLABLE = 3
"""


@pytest.fixture
def user_pkg(tmp_path, monkeypatch):
    pkg = tmp_path / "usermodels_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bigram.py").write_text(USER_MODULE)
    (pkg / "broken.py").write_text("raise RuntimeError('boom\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "usermodels_pkg"


def test_user_factory(user_pkg):
    m = build_model(cfg(factory=f"{user_pkg}.bigram:build"), 11)
    assert m(tokens(vocab=11)).shape == (2, 16, 11)
    assert isinstance(m, ModelProtocol)
    assert build_model(cfg(factory=f"{user_pkg}.bigram:build_noargs"), 11).emb.num_embeddings == 7


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nopkg_xyz.mod:fn", "cannot import 'nopkg_xyz.mod' (ModuleNotFoundError: No module named 'nopkg_xyz')"),
        ("{pkg}.broken:fn", "cannot import '{pkg}.broken' (RuntimeError: boom second line)"),
        ("{pkg}.bigram:missing", "module '{pkg}.bigram' has no attribute 'missing'"),
        ("{pkg}.bigram:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not callable"),
        ("{pkg}.bigram:build_bad", "returned str, not a torch.nn.Module"),
        ("{pkg}.bigram", "must have the form 'pkg.module:function'"),
        ("{pkg}.bigram:", "must have the form 'pkg.module:function'"),
    ],
)  # fmt: skip
def test_user_factory_errors(user_pkg, spec, message):
    spec = spec.format(pkg=user_pkg)
    with pytest.raises(ModelError) as info:
        build_model(cfg(factory=spec), 11)
    text = str(info.value)
    assert text.startswith(f"model.factory={spec!r}")
    assert message.format(pkg=user_pkg) in text
    assert "\n" not in text


def test_hf_key_mapping_round_trips_and_refuses_strangers():
    from meshrun.models.hf_keys import from_hf_key, to_hf_key

    for ours, theirs in [("tok_embeddings.weight", "model.embed_tokens.weight"),
                         ("layers.11.self_attn.q_proj.weight", "model.layers.11.self_attn.q_proj.weight"),
                         ("norm.weight", "model.norm.weight"), ("output.weight", "lm_head.weight")]:
        assert to_hf_key(ours) == theirs and from_hf_key(theirs) == ours
    with pytest.raises(KeyError):
        to_hf_key("model.layers.0.x")
    with pytest.raises(KeyError):
        from_hf_key("transformer.h.0.attn.c_attn.weight")
