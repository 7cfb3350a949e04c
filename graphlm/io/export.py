"""Export a GPT to other runtimes: a Hugging Face GPT-2 folder and a GGUF file for llama.cpp.

    export_hf(config, params, "out/tinylm-hf")      # config.json + model.safetensors
    export_gguf(config, params, "tinylm.gguf")      # llama.cpp's "gpt2" architecture
    unsupported(config, "gguf")                     # what the target cannot represent ([] = fine)

Both targets are GPT-2: LayerNorm, a GELU MLP (tanh approximation for GGUF; llama.cpp's GELU
is the tanh one), learned positions, biased linears, no LM-head bias. A model outside that is
refused naming every difference (`ExportError`); missing attention or MLP biases (the
``*_bias=False`` variants) are written as zeros, which represents them exactly.

Hugging Face: the tensor layout is the importer's (graphlm.io.hf_gpt2.hf_gpt2_layout), run
backwards, so ``load_hf_gpt2(export_hf(...))`` gives back the same arrays; an untied head is
written as ``lm_head.weight`` with ``"tie_word_embeddings": false``. A byte-level model (V=256)
also gets GPT-2's tokenizer files: vocab.json with the 256 byte tokens (spelled as below) and a
merges.txt without merges, so GPT2TokenizerFast maps text to graphlm's byte ids.

GGUF (written with the ggml project's `gguf` package): tensor names from gguf's gpt2 table; the
fused QKV rows as ``attn_qkv`` ``[3C, C]`` (q rows, then k, then v), every weight in the
``[out, in]`` layout ggml expects; float32. The tokenizer is graphlm's byte vocabulary: token
i is byte i, spelled with GPT-2's byte-to-unicode map, so llama.cpp's byte-level BPE maps text
to the same ids; there is one merge, of the bytes 0xFE and 0xFF, which never occur in UTF-8
text, because llama.cpp refuses a gpt2 tokenizer with no merges. Token ids past 255 (a padded
vocabulary) are unused placeholders.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Mapping

import numpy as np

from ..models.gpt import GPTConfig
from .hf_gpt2 import CONFIG_FILE, LM_HEAD_KEY, WEIGHTS_FILE, hf_gpt2_layout

TARGETS = ("hf", "gguf")
BYTE_TOKENS = 256
HF_VOCAB_FILE, HF_MERGES_FILE = "vocab.json", "merges.txt"     # GPT-2's tokenizer files
CLEAN_PRESET = "tinylm-gpt2"      # TinyLM without the LM-head bias: exports to both targets


class ExportError(ValueError):
    """A model the target cannot represent, or a destination that cannot be written."""


def unsupported(config: GPTConfig, target: str) -> list[str]:
    """What `config` has that `target` ("hf" or "gguf") cannot represent; [] when it exports."""
    if target not in TARGETS:
        raise ExportError(f"unknown export target {target!r}; known: {', '.join(TARGETS)}")
    out = []
    if config.norm != "layernorm":
        out.append(f"norm {config.norm!r} (GPT-2 has LayerNorm)")
    if config.mlp != "gelu":
        out.append(f"mlp {config.mlp!r} (GPT-2 has a GELU MLP, not SwiGLU)")
    if config.lm_head_bias:
        out.append("an LM-head bias, language_model_head.bias (GPT-2's head has none)")
    if target == "gguf" and config.gelu_approximate != "tanh":
        out.append(f"gelu_approximate {config.gelu_approximate!r} (llama.cpp's gpt2 uses the tanh "
                   "approximation)")
    return out


def check_exportable(config: GPTConfig, target: str) -> None:
    """Raise ExportError naming every difference `target` cannot represent."""
    problems = unsupported(config, target)
    if problems:
        name = {"hf": "Hugging Face GPT-2", "gguf": "llama.cpp's gpt2 (GGUF)"}[target]
        raise ExportError(f"cannot export to {name}: the model has {'; '.join(problems)}. The "
                          f"preset {CLEAN_PRESET!r} (TinyLM without the head bias) exports cleanly: "
                          f"graphlm train --preset {CLEAN_PRESET}")


def _full_params(config: GPTConfig, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`params` as float32, with zero biases for a model built without them (GPT-2 has them)."""
    c, hidden = config.channels, config.mlp_width
    zeros = {}
    for i in range(config.layer_count):
        b = f"blocks.{i}."
        if not config.attention_bias:
            zeros[b + "attention.qkv_bias"] = (3, c)
            zeros[b + "attention.output.bias"] = (c,)
        if not config.mlp_bias:
            zeros[b + "mlp_input.bias"] = (hidden,)
            zeros[b + "mlp_output.bias"] = (c,)
    out = {k: np.zeros(shape, np.float32) for k, shape in zeros.items()}
    for k, a in params.items():
        a = np.asarray(a)
        if not np.isfinite(a).all():
            raise ExportError(f"parameter {k} has non-finite values; nothing was written")
        out[k] = np.ascontiguousarray(a, dtype=np.float32)
    return out


def _write_atomic(path: Path, write) -> None:
    """Call write(tmp_path) on a temporary file next to `path`, then rename it into place."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _check_destination(path: Path, overwrite: bool, what: str) -> None:
    if path.exists() and not overwrite:
        raise ExportError(f"{path} already exists; choose another {what} or pass --force")
    if path.is_dir():
        raise ExportError(f"cannot write {path}: it is a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create {path.parent}: {e.strerror or e}") from None


# -- Hugging Face ----------------------------------------------------------------------------------
def hf_config(config: GPTConfig) -> dict:
    """The config.json of transformers' GPT2LMHeadModel for `config`."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.context_length,
        "n_ctx": config.context_length, "n_embd": config.channels, "n_head": config.head_count,
        "n_layer": config.layer_count, "n_inner": config.mlp_hidden,   # None: GPT-2's 4 * n_embd
        "activation_function": {"tanh": "gelu_new", "none": "gelu"}[config.gelu_approximate],
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "tie_word_embeddings": bool(config.tie_weights),
        "bos_token_id": None, "eos_token_id": None,
        "torch_dtype": "float32", "exported_by": "graphlm",
    }


def hf_tensors(config: GPTConfig, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GPT2LMHeadModel's state dict (``transformer.*`` and, untied, ``lm_head.weight``)."""
    check_exportable(config, "hf")
    full = _full_params(config, params)
    out = {}
    for name, (key, _, to_hf, shape) in hf_gpt2_layout(config).items():
        if name not in full:
            raise ExportError(f"parameter {name} is missing from the model's params")
        a = np.ascontiguousarray(to_hf(full[name]), dtype=np.float32)
        if a.shape != shape:
            raise ExportError(f"parameter {name} has shape {a.shape} in GPT-2's layout, expected {shape}")
        out[key if key == LM_HEAD_KEY else "transformer." + key] = a
    return out


def export_hf(config: GPTConfig, params: Mapping[str, np.ndarray], directory: str | os.PathLike,
              overwrite: bool = False) -> Path:
    """Write `directory`/config.json and model.safetensors; returns the directory."""
    import safetensors.numpy

    directory = Path(directory)
    tensors = hf_tensors(config, params)         # refuses before anything is written
    if directory.exists() and not directory.is_dir():
        raise ExportError(f"{directory} exists and is not a directory")
    for name in (CONFIG_FILE, WEIGHTS_FILE, HF_VOCAB_FILE, HF_MERGES_FILE):
        if (directory / name).exists() and not overwrite:
            raise ExportError(f"{directory / name} already exists; choose another folder or pass --force")
    try:
        directory.mkdir(parents=True, exist_ok=True)      # as save_pretrained does
    except OSError as e:
        raise ExportError(f"cannot create {directory}: {e.strerror or e}") from None
    payload = safetensors.numpy.save(tensors, metadata={"format": "pt"})

    def write_bytes(data: bytes):
        return lambda tmp: Path(tmp).write_bytes(data)

    _write_atomic(directory / WEIGHTS_FILE, write_bytes(payload))
    if config.vocab_size == BYTE_TOKENS:     # graphlm's byte vocabulary as a GPT-2 tokenizer
        spelled = bytes_to_unicode()
        vocab = json.dumps({spelled[b]: b for b in range(BYTE_TOKENS)}, ensure_ascii=False)
        _write_atomic(directory / HF_VOCAB_FILE, write_bytes(vocab.encode()))
        _write_atomic(directory / HF_MERGES_FILE, write_bytes(b"#version: 0.2\n"))
    text = json.dumps(hf_config(config), indent=2) + "\n"
    _write_atomic(directory / CONFIG_FILE, write_bytes(text.encode()))
    return directory


# -- GGUF ------------------------------------------------------------------------------------------
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (byte-level BPE's alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def gguf_vocabulary(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the byte tokenizer: token i is byte i in GPT-2's spelling."""
    import gguf

    if vocab_size < BYTE_TOKENS:
        raise ExportError(f"the GGUF tokenizer is graphlm's 256 byte tokens; the model's vocab_size "
                          f"is {vocab_size}")
    spelled = bytes_to_unicode()
    tokens = [spelled[b] for b in range(BYTE_TOKENS)]
    types = [int(gguf.TokenType.NORMAL)] * BYTE_TOKENS
    tokens += [f"<unused{i}>" for i in range(BYTE_TOKENS, vocab_size)]
    types += [int(gguf.TokenType.UNUSED)] * (vocab_size - BYTE_TOKENS)
    merges = [f"{spelled[0xFE]} {spelled[0xFF]}"]     # never fires on UTF-8 text
    return tokens, types, merges


def gguf_tensors(config: GPTConfig, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """llama.cpp gpt2 tensor name -> float32 array (numpy shape [out, in] for weights)."""
    import gguf

    check_exportable(config, "gguf")
    full = _full_params(config, params)
    names = gguf.TENSOR_NAMES
    T = gguf.MODEL_TENSOR
    c = config.channels

    def name(kind, i=None, suffix="weight"):
        return (names[kind].format(bid=i) if i is not None else names[kind]) + "." + suffix

    out = {name(T.TOKEN_EMBD): full["token_embedding.weight"],
           name(T.POS_EMBD): full["positional_embedding.table.weight"]}
    for i in range(config.layer_count):
        b = f"blocks.{i}."
        qkv = full[b + "attention.qkv_weight"]            # [3, C_in, C_out]: x @ W[j]
        out.update({
            name(T.ATTN_NORM, i): full[b + "attention_norm.weight"],
            name(T.ATTN_NORM, i, "bias"): full[b + "attention_norm.bias"],
            name(T.ATTN_QKV, i): qkv.transpose(0, 2, 1).reshape(3 * c, c),
            name(T.ATTN_QKV, i, "bias"): full[b + "attention.qkv_bias"].reshape(3 * c),
            name(T.ATTN_OUT, i): full[b + "attention.output.weight"],
            name(T.ATTN_OUT, i, "bias"): full[b + "attention.output.bias"],
            name(T.FFN_NORM, i): full[b + "mlp_norm.weight"],
            name(T.FFN_NORM, i, "bias"): full[b + "mlp_norm.bias"],
            name(T.FFN_UP, i): full[b + "mlp_input.weight"],
            name(T.FFN_UP, i, "bias"): full[b + "mlp_input.bias"],
            name(T.FFN_DOWN, i): full[b + "mlp_output.weight"],
            name(T.FFN_DOWN, i, "bias"): full[b + "mlp_output.bias"],
        })
    out[name(T.OUTPUT_NORM)] = full["final_norm.weight"]
    out[name(T.OUTPUT_NORM, suffix="bias")] = full["final_norm.bias"]
    if not config.tie_weights:                    # llama.cpp reuses token_embd when absent
        out[name(T.OUTPUT)] = full["language_model_head.weight"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def export_gguf(config: GPTConfig, params: Mapping[str, np.ndarray], path: str | os.PathLike,
                name: str = "graphlm-gpt", overwrite: bool = False) -> Path:
    """Write a GGUF file of `config` and `params` in llama.cpp's gpt2 layout; returns the path."""
    import gguf

    path = Path(path)
    tensors = gguf_tensors(config, params)       # refuses before anything is written
    tokens, types, merges = gguf_vocabulary(config.vocab_size)
    _check_destination(path, overwrite, "output file")
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT2]

    def write(tmp: str) -> None:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name(name)
        w.add_context_length(config.context_length)
        w.add_embedding_length(config.channels)
        w.add_feed_forward_length(config.mlp_width)
        w.add_block_count(config.layer_count)
        w.add_head_count(config.head_count)
        w.add_layer_norm_eps(config.layer_norm_epsilon)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        for key, array in tensors.items():
            w.add_tensor(key, array)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    _write_atomic(path, write)
    return path


__all__ = ["TARGETS", "CLEAN_PRESET", "ExportError", "unsupported", "check_exportable", "hf_config",
           "hf_tensors", "export_hf", "bytes_to_unicode", "gguf_vocabulary", "gguf_tensors",
           "export_gguf"]
