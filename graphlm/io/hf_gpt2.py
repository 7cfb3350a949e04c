"""Import a Hugging Face GPT-2 checkpoint (``config.json`` + ``model.safetensors``).

Hugging Face's GPT-2 uses Conv1D layers that store weights ``[in, out]`` and apply ``x @ W + b``;
graphlm's Linear stores ``[out, in]`` and applies ``x @ W.T + b``, so those weights are transposed.
The fused ``c_attn`` weight ``[C, 3C]`` computes ``[q | k | v] = x @ c_attn``; graphlm's
``qkv_weight[j]`` is applied as ``x @ W[j]``, so ``W[j] = c_attn[:, j*C:(j+1)*C]``. The LM head
has no bias; it is tied to ``wte`` unless config.json says ``"tie_word_embeddings": false`` (then
it is ``lm_head.weight``, as graphlm.io.export writes an untied model).

    config, params = load_hf_gpt2("gpt2/")
    model = GPT(config)
    logits = model.logits(params, tokens)
"""
from __future__ import annotations

import json
import os
from typing import Callable

import numpy as np

from ..ir import fmt_shape
from ..models.gpt import GPTConfig
from .files import read_regular

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
LM_HEAD_KEY = "lm_head.weight"     # an untied head (config "tie_word_embeddings": false)
_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}


def _read_config(path: str) -> GPTConfig:
    if not os.path.isfile(path):
        raise ValueError(f"{path}: file not found (a Hugging Face GPT-2 directory has "
                         f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:   # (a regular file of at most 1 MiB: a config is a few hundred bytes)
        raw = json.loads(read_regular(path, "GPT-2 config", max_bytes=1 << 20).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: cannot read the GPT-2 config: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")

    def field(*keys, default=None):
        for k in keys:
            if k in raw:
                return raw[k]
        if default is None:
            raise ValueError(f"{path}: missing key {keys[0]!r}")
        return default

    act = field("activation_function", default="gelu_new")
    if act not in _GELU:
        raise ValueError(f"{path}: key 'activation_function' is {act!r}; supported: {', '.join(_GELU)}")
    try:
        return GPTConfig(
            vocab_size=field("vocab_size", "n_vocab"),
            context_length=field("n_positions", "n_ctx"),
            channels=field("n_embd"),
            head_count=field("n_head"),
            layer_count=field("n_layer"),
            dropout=0.0,  # an imported model is for inference/fine-tuning; set it with replace()
            layer_norm_epsilon=field("layer_norm_epsilon", default=1e-5),
            gelu_approximate=_GELU[act],
            tie_weights=bool(field("tie_word_embeddings", default=True)),
            lm_head_bias=False,
            mlp_hidden=raw.get("n_inner"),  # null in GPT-2's own configs: 4 * n_embd
        )
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def hf_gpt2_layout(config: GPTConfig) -> dict[str, tuple[str, Callable, Callable, tuple]]:
    """graphlm name -> (HF key without the ``transformer.`` prefix, HF array -> graphlm array,
    graphlm array -> HF array, HF shape): the one description of the layout, read by the
    importer and by graphlm.io.export. An untied head is ``lm_head.weight`` (never prefixed)."""
    c, v, t, f = config.channels, config.vocab_size, config.context_length, config.mlp_width
    ident = lambda a: a  # noqa: E731
    out = {
        "token_embedding.weight": ("wte.weight", ident, ident, (v, c)),
        "positional_embedding.table.weight": ("wpe.weight", ident, ident, (t, c)),
    }
    for i in range(config.layer_count):
        h, b = f"h.{i}.", f"blocks.{i}."
        out.update({
            b + "attention_norm.weight": (h + "ln_1.weight", ident, ident, (c,)),
            b + "attention_norm.bias": (h + "ln_1.bias", ident, ident, (c,)),
            b + "attention.qkv_weight": (h + "attn.c_attn.weight",
                                         lambda a: a.reshape(c, 3, c).transpose(1, 0, 2),
                                         lambda w: w.transpose(1, 0, 2).reshape(c, 3 * c), (c, 3 * c)),
            b + "attention.qkv_bias": (h + "attn.c_attn.bias", lambda a: a.reshape(3, c),
                                       lambda w: w.reshape(3 * c), (3 * c,)),
            b + "attention.output.weight": (h + "attn.c_proj.weight", np.transpose, np.transpose, (c, c)),
            b + "attention.output.bias": (h + "attn.c_proj.bias", ident, ident, (c,)),
            b + "mlp_norm.weight": (h + "ln_2.weight", ident, ident, (c,)),
            b + "mlp_norm.bias": (h + "ln_2.bias", ident, ident, (c,)),
            b + "mlp_input.weight": (h + "mlp.c_fc.weight", np.transpose, np.transpose, (c, f)),
            b + "mlp_input.bias": (h + "mlp.c_fc.bias", ident, ident, (f,)),
            b + "mlp_output.weight": (h + "mlp.c_proj.weight", np.transpose, np.transpose, (f, c)),
            b + "mlp_output.bias": (h + "mlp.c_proj.bias", ident, ident, (c,)),
        })
    out["final_norm.weight"] = ("ln_f.weight", ident, ident, (c,))
    out["final_norm.bias"] = ("ln_f.bias", ident, ident, (c,))
    if not config.tie_weights:
        out["language_model_head.weight"] = (LM_HEAD_KEY, ident, ident, (v, c))
    return out


def hf_gpt2_mapping(config: GPTConfig) -> dict[str, tuple[str, Callable[[np.ndarray], np.ndarray], tuple]]:
    """graphlm name -> (HF key without prefix, transform of the HF array, expected HF shape)."""
    return {name: (key, to_graphlm, shape)
            for name, (key, to_graphlm, _, shape) in hf_gpt2_layout(config).items()}


def load_hf_gpt2(directory: str | os.PathLike) -> tuple[GPTConfig, dict[str, np.ndarray]]:
    """Read a Hugging Face GPT-2 directory into ``(GPTConfig, params)`` (float32 arrays named as
    graphlm's GPT names them). Keys may carry the ``transformer.`` prefix (GPT2LMHeadModel) or not
    (GPT2Model). A missing or unreadable file, a missing key, a tensor of the wrong shape or a
    non-finite value raises ValueError naming the file and key."""
    from safetensors import SafetensorError, safe_open

    directory = os.fspath(directory)
    config = _read_config(os.path.join(directory, CONFIG_FILE))
    path = os.path.join(directory, WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: file not found (only the safetensors format is read)")
    params: dict[str, np.ndarray] = {}
    try:
        with safe_open(path, framework="numpy") as f:
            keys = set(f.keys())
            prefix = "transformer." if "transformer.wte.weight" in keys else ""
            for name, (key, transform, shape) in hf_gpt2_mapping(config).items():
                full = key if key == LM_HEAD_KEY else prefix + key
                if full not in keys:
                    raise ValueError(f"{path}: missing tensor {full!r} (needed for {name})")
                arr = f.get_tensor(full)
                if arr.shape != shape:
                    raise ValueError(f"{path}: tensor {full!r} has shape {fmt_shape(arr.shape)}, "
                                     f"expected {fmt_shape(shape)} for the config in {CONFIG_FILE}")
                if arr.dtype.kind != "f":
                    raise ValueError(f"{path}: tensor {full!r} has dtype {arr.dtype}, expected floats")
                arr = np.ascontiguousarray(transform(arr.astype(np.float32)))
                if not np.isfinite(arr).all():
                    raise ValueError(f"{path}: tensor {full!r} has non-finite values")
                params[name] = arr
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    except (OSError, TypeError) as e:  # truncated headers surface as these in some versions
        raise ValueError(f"{path}: cannot read tensors ({e})") from None
    return config, params


__all__ = ["load_hf_gpt2", "hf_gpt2_mapping", "hf_gpt2_layout", "LM_HEAD_KEY"]
