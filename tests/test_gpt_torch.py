"""GPT logits and gradients against an equivalent PyTorch model with the same weights (float32).

The PyTorch model is written here from torch.nn.functional (F.embedding, F.layer_norm /
F.rms_norm, F.scaled_dot_product_attention with is_causal, F.gelu, F.silu, F.linear,
F.cross_entropy), independently of graphlm's code; it reads graphlm's parameter dict.
"""
from __future__ import annotations

import numpy as np
import pytest

from graphlm import executors  # noqa: F401
from graphlm.models import GPT, GPTConfig

EX = "reference"

VARIANTS = {
    "layernorm-gelu-untied": dict(),
    "rmsnorm-swiglu-tied": dict(norm="rmsnorm", mlp="swiglu", tie_weights=True, lm_head_bias=False),
    "erf-gelu-no-biases": dict(gelu_approximate="none", attention_bias=False, mlp_bias=False,
                               lm_head_bias=False),
    "book-gpt-gelu-2C-tied": dict(norm="rmsnorm", mlp_hidden=32, attention_bias=False,
                                  mlp_bias=False, tie_weights=True, lm_head_bias=False),
    "swiglu-width-24": dict(mlp="swiglu", mlp_hidden=24),
}


def torch_gpt_logits(torch, cfg: GPTConfig, P: dict, tokens, attend=None):
    """The logits [B, T, V]; `attend(q, k, v) -> context` on [B, H, T, D] heads replaces
    F.scaled_dot_product_attention(is_causal=True) (tests/test_attention.py records the
    probabilities through it)."""
    F = torch.nn.functional
    if attend is None:
        attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    B, T = tokens.shape
    C, H = cfg.channels, cfg.head_count
    eps = cfg.layer_norm_epsilon

    def norm(x, prefix):
        if cfg.norm == "layernorm":
            return F.layer_norm(x, (C,), P[prefix + ".weight"], P[prefix + ".bias"], eps)
        return F.rms_norm(x, (C,), P[prefix + ".weight"], eps)

    def linear(x, prefix):
        return F.linear(x, P[prefix + ".weight"], P.get(prefix + ".bias"))

    x = F.embedding(tokens, P["token_embedding.weight"]) + P["positional_embedding.table.weight"][:T]
    for i in range(cfg.layer_count):
        b = f"blocks.{i}."
        h = norm(x, b + "attention_norm")
        W = P[b + "attention.qkv_weight"]
        qkv = [h @ W[j] + (P[b + "attention.qkv_bias"][j] if cfg.attention_bias else 0) for j in range(3)]
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in qkv)
        ctx = attend(q, k, v)
        x = x + linear(ctx.transpose(1, 2).reshape(B, T, C), b + "attention.output")
        h = linear(norm(x, b + "mlp_norm"), b + "mlp_input")
        if cfg.mlp == "swiglu":
            gate, value = h.chunk(2, dim=-1)
            h = F.silu(gate) * value
        else:
            h = F.gelu(h, approximate=cfg.gelu_approximate)
        x = x + linear(h, b + "mlp_output")
    head_w = P["token_embedding.weight"] if cfg.tie_weights else P["language_model_head.weight"]
    return F.linear(norm(x, "final_norm"), head_w, P.get("language_model_head.bias"))


def torch_gpt_loss(torch, cfg: GPTConfig, P: dict, tokens, targets):
    logits = torch_gpt_logits(torch, cfg, P, tokens)
    B, T = tokens.shape
    loss = torch.nn.functional.cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1))
    return logits, loss


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_gradients_match_torch(torch, variant):
    cfg = GPTConfig(vocab_size=11, context_length=6, channels=16, head_count=4, layer_count=2,
                    **VARIANTS[variant])
    m = GPT(cfg)
    r = np.random.default_rng(7)
    params = m.init(11)
    for k in params:  # move norms and biases off their trivial init so they are tested too
        params[k] = (params[k] + 0.1 * r.standard_normal(params[k].shape)).astype(np.float32)
    tokens = r.integers(0, cfg.vocab_size, (3, 5))
    targets = r.integers(0, cfg.vocab_size, (3, 5))

    logits = m.logits(params, tokens, executor=EX)
    loss, grads = m.loss_and_grads(params, tokens, targets, executor=EX)
    assert logits.dtype == np.float32 and all(g.dtype == np.float32 for g in grads.values())
    assert sorted(grads) == sorted(params)

    P = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    t_logits, t_loss = torch_gpt_loss(torch, cfg, P, torch.tensor(tokens), torch.tensor(targets))
    t_loss.backward()

    assert np.abs(logits - t_logits.detach().numpy()).max() <= 1e-4
    assert abs(loss - t_loss.item()) <= 1e-5
    for name, g in grads.items():
        ref = P[name].grad.numpy()
        scale = np.abs(ref).max()
        assert scale > 0, name
        err = np.abs(g - ref).max() / scale
        assert err <= 1e-4, f"{variant}: gradient of {name} differs from torch by {err:.2e} (relative)"
