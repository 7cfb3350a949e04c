"""Modules: descriptions of layers that add nodes to a graph when called on a tensor.

A module holds its configuration, its named child modules and its `Parameter` declarations
(shape + init policy); it holds no arrays. Calling a module on a tensor of graph `g` adds its nodes
to `g` under ``g.scope(<the module's name>)`` and binds each parameter as a ``g.param`` leaf whose
name is the dotted module path (``blocks.0.attention.qkv_weight``, design.md section 7). Values
live outside: `Module.init(seed)` makes the dict of float32 arrays that executors read as state.

    import graphlm as gl
    from graphlm import nn
    layer = nn.Linear(8, 4)
    g = gl.Graph(); x = g.input("x", (2, 8))
    y = layer(x)                       # binds params "weight" [4,8] and "bias" [4]
    params = layer.init(seed=0)        # {"weight": ..., "bias": ...}

Sharing: a `Parameter` object registered in two modules (a tied LM head) is one parameter. It is
listed once, under the first name met in tree order, and in a graph it is bound once: the second
module reuses the leaf the first one made.

Cached decoding: ``GPT(...)(tokens, cache=KVCache(g, T, position))`` passes a `KVCache` down
through `DecoderBlock` to `MultiheadAttention.attend_cached`, which makes the cache's `state`
leaves and its `cache_write` update nodes (graphlm.sample builds its prefill and decode graphs
this way).

Dropout draws from ``graphlm.dropout(x, p, key, stream)``. The key is the graph's scalar integer
leaf named ``dropout_key`` (an input, made on first use; a training program may instead declare a
``state`` of that name before building the model and it is used). Each Dropout module's stream is
``zlib.crc32`` of its dotted scope, so masks do not depend on build order. In eval mode, or with
p = 0, a Dropout adds no node.
"""
from __future__ import annotations

import math
import weakref
import zlib
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import numpy as np

from . import init as _init
from . import ops
from .ir import Graph, GraphError, ShapeError, Tensor, fmt_shape
from .random import SplitMix64

DROPOUT_KEY = "dropout_key"


# ================================================================================================
# parameters and the module base
# ================================================================================================

class Parameter:
    """A declared trainable tensor: shape, dtype and an init policy (no values)."""

    __slots__ = ("shape", "dtype", "init", "__weakref__")

    def __init__(self, shape: Sequence[int], init="zero", dtype="float32"):
        self.shape = tuple(int(d) for d in shape)
        if any(d <= 0 for d in self.shape):
            raise ValueError(f"Parameter: every dimension must be positive, got {fmt_shape(self.shape)}")
        self.dtype = np.dtype(dtype)
        self.init = _init.get_policy(init)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __repr__(self):
        return f"Parameter({fmt_shape(self.shape)} {self.dtype}, init={getattr(self.init, '__name__', self.init)})"


# per graph: Parameter -> the leaf it is bound to (so a shared Parameter is one leaf)
_BINDINGS: "weakref.WeakKeyDictionary[Graph, dict[Parameter, Tensor]]" = weakref.WeakKeyDictionary()


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


class Module:
    """Base class: named children and parameters, train/eval mode, graph building.

    Subclasses declare parameters and children as attributes in ``__init__`` (after calling
    ``super().__init__()``) and implement ``forward(*inputs) -> Tensor``. Attribute order is
    registration order, which fixes `parameters()` order.
    """

    def __init__(self):
        object.__setattr__(self, "_children", {})
        object.__setattr__(self, "_params", {})
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "name", "")

    def __setattr__(self, key, value):
        if "_children" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}: call Module.__init__ before setting attributes")
        self._children.pop(key, None)
        self._params.pop(key, None)
        if isinstance(value, Module):
            self._children[key] = value
            if not value.name:
                object.__setattr__(value, "name", key)
            if isinstance(value, ModuleList):  # a list adds no scope of its own: blocks.0, ...
                for i, item in enumerate(value):
                    if item.name == str(i):
                        object.__setattr__(item, "name", f"{value.name}.{i}")
        elif isinstance(value, Parameter):
            self._params[key] = value
        object.__setattr__(self, key, value)

    # -- the tree ----------------------------------------------------------------------------------
    def children(self) -> dict[str, "Module"]:
        return dict(self._children)

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        """(dotted path, module) for this module and every descendant, depth first."""
        yield prefix, self
        for name, child in self._children.items():
            yield from child.named_modules(_join(prefix, name))

    def parameters(self, prefix: str = "") -> dict[str, Parameter]:
        """Dotted name -> Parameter, in a fixed order (own parameters, then children in order).

        A Parameter reachable under two names is listed once, under the first.
        """
        out: dict[str, Parameter] = {}
        seen: set[int] = set()
        for path, module in self.named_modules(prefix):
            for name, p in module._params.items():
                if id(p) not in seen:
                    seen.add(id(p))
                    out[_join(path, name)] = p
        return out

    def parameter_count(self) -> int:
        """The number of trainable elements (shared parameters counted once). Builds no arrays."""
        return sum(p.size for p in self.parameters().values())

    def init(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Fresh float32 values for every parameter, drawn from one splitmix64 stream in
        `parameters()` order: deterministic for a seed, different across seeds."""
        rng = SplitMix64(seed)
        out = {}
        for name, p in self.parameters().items():
            arr = np.ascontiguousarray(p.init(p.shape, rng), dtype=p.dtype)
            if arr.shape != p.shape:
                raise ValueError(f"init policy for '{name}' gave {fmt_shape(arr.shape)}, "
                                 f"expected {fmt_shape(p.shape)}")
            out[name] = arr
        return out

    def astype(self, dtype) -> "Module":
        """Declare every parameter with `dtype` (float64 for gradient checks); returns self."""
        dtype = np.dtype(dtype)
        if dtype.kind != "f":
            raise ValueError(f"{type(self).__name__}.astype: parameters must be floating point, got {dtype}")
        for p in self.parameters().values():
            p.dtype = dtype
        return self

    # -- modes ---------------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> "Module":
        """Set training mode on this module and every descendant; returns self."""
        for _, m in self.named_modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self) -> "Module":
        return self.train(False)

    # -- graph building --------------------------------------------------------------------------------
    def __call__(self, *inputs, **kwargs) -> Tensor:
        g = _graph_of(inputs, type(self).__name__)
        with g.scope(self.name):
            return self.forward(*inputs, **kwargs)

    def forward(self, *inputs, **kwargs) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__}.forward")

    def bind(self, g: Graph, name: str) -> Tensor:
        """The leaf of parameter `name` of this module in graph `g` (made on first use).

        Call inside the module's scope (as `forward` is): the leaf is named by the current scope
        plus `name`. An existing param of that name is reused if its shape and dtype agree.
        """
        p = self._params[name]
        bound = _BINDINGS.setdefault(g, {})
        if p in bound:
            return bound[p]
        full = _join(g.current_scope, name)
        leaf = g.params.get(full)
        if leaf is None:
            leaf = g.param(full, p.shape, p.dtype)
        elif leaf.shape != p.shape or leaf.dtype != p.dtype:
            raise GraphError(f"{type(self).__name__} '{g.current_scope or '<root>'}': graph "
                             f"'{g.name}' already has param '{full}' as {fmt_shape(leaf.shape)} "
                             f"{leaf.dtype}, but the module declares {fmt_shape(p.shape)} {p.dtype}")
        bound[p] = leaf
        return leaf

    def child_param(self, g: Graph, child: str, name: str) -> Tensor:
        """Bind parameter `name` of child module `child` without calling the child."""
        module = self._children[child]
        with g.scope(module.name):
            return module.bind(g, name)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self):
        lines = [f"{type(self).__name__}({self.extra_repr()})"]
        for name, p in self._params.items():
            lines.append(f"  {name}: {p!r}")
        for name, c in self._children.items():
            lines.append("  " + f"{name}: {c!r}".replace("\n", "\n  "))
        return "\n".join(lines)


def _graph_of(inputs, who: str) -> Graph:
    for x in inputs:
        if isinstance(x, Tensor):
            return x.graph
    raise TypeError(f"{who}: expects a graphlm.Tensor input, got "
                    f"{', '.join(type(x).__name__ for x in inputs) or 'nothing'}")


class ModuleList(Module):
    """An indexed list of modules, named "0", "1", ... (so ``blocks.3.attention``).

    It is a container, not a layer: it is never called, and its items build their nodes in the
    scope ``<list name>.<i>`` of the module that holds the list.
    """

    def __init__(self, modules: Sequence[Module] = ()):
        super().__init__()
        for i, m in enumerate(modules):
            setattr(self, str(i), m)

    def __len__(self):
        return len(self._children)

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self._children.values()))

    def __getitem__(self, i: int) -> Module:
        return list(self._children.values())[i]


# ================================================================================================
# activations
# ================================================================================================

def swiglu(h: Tensor) -> Tensor:
    """``silu(gate) * value`` where gate is the first half of the last axis and value the second."""
    gate, value = ops.split(h, 2, axis=-1)
    return ops.silu(gate) * value


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": ops.relu,
    "gelu": lambda x: ops.gelu(x, "tanh"),
    "gelu_tanh": lambda x: ops.gelu(x, "tanh"),
    "gelu_erf": lambda x: ops.gelu(x, "none"),
    "silu": ops.silu,
    "sigmoid": ops.sigmoid,
    "tanh": ops.tanh,
    "swiglu": swiglu,
}


def get_activation(act) -> Callable[[Tensor], Tensor] | None:
    """An activation by name, a callable, or None (identity)."""
    if act is None or callable(act):
        return act
    try:
        return ACTIVATIONS[act]
    except (KeyError, TypeError):
        raise ValueError(f"unknown activation {act!r}; known: {', '.join(ACTIVATIONS)}") from None


# ================================================================================================
# layers
# ================================================================================================

def _check_last_dim(module: Module, x: Tensor, width: int, what: str = "input"):
    g = x.graph
    if x.ndim < 1 or x.shape[-1] != width:
        raise ShapeError(f"{type(module).__name__} '{g.current_scope or '<root>'}': {what} "
                         f"{fmt_shape(x.shape)} must have last dimension {width}")


def _positive(cls: str, **values):
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{cls}: {k} must be a positive integer, got {v!r}")


class Linear(Module):
    """``y = x @ weight.T + bias`` with weight ``[out, in]`` (PyTorch's layout)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 weight_init="xavier_uniform", bias_init="zero"):
        super().__init__()
        _positive("Linear", in_features=in_features, out_features=out_features)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight = Parameter((out_features, in_features), weight_init)
        self.bias = Parameter((out_features,), bias_init) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        """Leading axes are folded into the rows of one 2-D product (as torch's F.linear does):
        one large GEMM instead of a batch of small ones (docs/performance.md)."""
        _check_last_dim(self, x, self.in_features)
        rows = ops.reshape(x, (-1, self.in_features)) if x.ndim > 2 else x
        y = rows @ ops.transpose(self.bind(x.graph, "weight"))
        if self.bias is not None:
            y = y + self.bind(x.graph, "bias")
        return ops.reshape(y, x.shape[:-1] + (self.out_features,)) if x.ndim > 2 else y

    def extra_repr(self):
        return f"{self.in_features} -> {self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """``weight[ids]`` for integer ids of any shape; weight ``[num_embeddings, dim]``."""

    def __init__(self, num_embeddings: int, dim: int, weight_init="xavier_uniform"):
        super().__init__()
        _positive("Embedding", num_embeddings=num_embeddings, dim=dim)
        self.num_embeddings, self.dim = int(num_embeddings), int(dim)
        self.weight = Parameter((num_embeddings, dim), weight_init)

    def forward(self, ids: Tensor) -> Tensor:
        if ids.dtype.kind not in "iu":
            raise ShapeError(f"Embedding '{ids.graph.current_scope or '<root>'}': ids must be an "
                             f"integer tensor, got {ids.dtype} {fmt_shape(ids.shape)}")
        return ops.embedding(self.bind(ids.graph, "weight"), ids)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.dim}"


class PositionalEmbedding(Module):
    """Adds a learned position vector to each position of ``x [B, T, C]``.

    The table is a child Embedding ``table`` of ``[context_length, C]``. Without `positions` the
    rows 0..T-1 are added (a slice of the table); with an integer `positions` tensor (e.g. ``[T]``
    or ``[B, T]``, for decoding with a cache) those rows are gathered and added.
    """

    def __init__(self, context_length: int, dim: int, weight_init="xavier_uniform"):
        super().__init__()
        _positive("PositionalEmbedding", context_length=context_length, dim=dim)
        self.context_length, self.dim = int(context_length), int(dim)
        self.table = Embedding(context_length, dim, weight_init)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        g = x.graph
        _check_last_dim(self, x, self.dim)
        if positions is not None:
            return x + self.table(positions)
        if x.ndim < 2 or x.shape[-2] > self.context_length:
            raise ShapeError(f"PositionalEmbedding '{g.current_scope or '<root>'}': input "
                             f"{fmt_shape(x.shape)} needs a sequence axis of at most "
                             f"{self.context_length} positions")
        table = self.child_param(g, "table", "weight")
        with g.scope(self.table.name):
            rows = table[: x.shape[-2]]
        return x + rows


class LayerNorm(Module):
    """Layer normalization over the last axis with weight (ones) and bias (zeros)."""

    def __init__(self, width: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        _positive("LayerNorm", width=width)
        _check_eps("LayerNorm", eps)
        self.width, self.eps = int(width), float(eps)
        self.weight = Parameter((width,), "one")
        self.bias = Parameter((width,), "zero") if bias else None

    def forward(self, x: Tensor) -> Tensor:
        _check_last_dim(self, x, self.width)
        g = x.graph
        w = self.bind(g, "weight")
        b = self.bind(g, "bias") if self.bias is not None else None
        return ops.layer_norm(x, w, b, eps=self.eps)

    def extra_repr(self):
        return f"{self.width}, eps={self.eps}"


class RMSNorm(Module):
    """RMS normalization over the last axis with weight (ones), no bias."""

    def __init__(self, width: int, eps: float = 1e-5):
        super().__init__()
        _positive("RMSNorm", width=width)
        _check_eps("RMSNorm", eps)
        self.width, self.eps = int(width), float(eps)
        self.weight = Parameter((width,), "one")

    def forward(self, x: Tensor) -> Tensor:
        _check_last_dim(self, x, self.width)
        return ops.rms_norm(x, self.bind(x.graph, "weight"), eps=self.eps)

    def extra_repr(self):
        return f"{self.width}, eps={self.eps}"


def _check_eps(cls, eps):
    if not isinstance(eps, (int, float, np.floating)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"{cls}: eps must be a finite positive number, got {eps!r}")


def _check_p(cls, p):
    if not isinstance(p, (int, float, np.floating)) or not 0.0 <= float(p) < 1.0:
        raise ValueError(f"{cls}: dropout probability must be in [0, 1), got {p!r}")


def dropout_key(g: Graph) -> Tensor:
    """The graph's dropout key leaf: an existing input or state named ``dropout_key``, else a new
    int64 scalar input of that name."""
    key = g.inputs.get(DROPOUT_KEY, g.states.get(DROPOUT_KEY))
    if key is None:
        key = g.input(DROPOUT_KEY, (), "int64")
    if key.shape != () or key.dtype.kind not in "iu":
        raise GraphError(f"graph '{g.name}': '{DROPOUT_KEY}' must be a scalar integer leaf, got "
                         f"{fmt_shape(key.shape)} {key.dtype}")
    return key


class Dropout(Module):
    """Inverted dropout in training mode; no node at all in eval mode or when p = 0."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        _check_p("Dropout", p)
        self.p = float(p)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        g = x.graph
        stream = zlib.crc32(g.current_scope.encode("utf-8"))
        return ops.dropout(x, self.p, dropout_key(g), stream=stream)

    def extra_repr(self):
        return f"p={self.p}"


class KVCache:
    """The keys and values of the attention modules of one graph, kept across runs as `state`.

    A graph built with a cache is either a *prefill* (``position=None``: the L new tokens are at
    positions 0..L-1) or one *decode* step (``position`` a scalar integer tensor of the graph:
    one new token per row, at that position). Each `MultiheadAttention` called with ``cache=``
    gets two state leaves ``{prefix}.{its scope}.k`` / ``.v`` of shape ``[B, H, capacity, D]``
    (made on first use, so any model whose attention modules pass the cache along is cached)
    and adds `cache_write` update nodes that store its new keys and values at the position.
    Compile `writes` among the program's outputs: update nodes run after every other node, so a
    decode step reads the cache as it was before the step.
    """

    def __init__(self, graph: Graph, capacity: int, position: Tensor | None = None,
                 prefix: str = "cache"):
        _positive("KVCache", capacity=capacity)
        if position is not None and (not isinstance(position, Tensor) or position.graph is not graph
                                     or position.shape != () or position.dtype.kind not in "iu"):
            raise GraphError(f"KVCache: position must be a scalar integer tensor of graph "
                             f"'{graph.name}', got {position!r}")
        self.graph, self.capacity, self.position, self.prefix = graph, int(capacity), position, prefix
        self.writes: list[Tensor] = []

    def positions(self, length: int) -> Tensor | None:
        """Positions of `length` new tokens for a positional embedding: None (0..length-1) in a
        prefill, ``[position]`` in a decode step."""
        if self.position is None:
            if length > self.capacity:
                raise ShapeError(f"KVCache: a prefill of {length} tokens exceeds the cache's "
                                 f"{self.capacity} positions")
            return None
        if length != 1:
            raise ShapeError(f"KVCache: a decode step takes one token per row, got {length}")
        return ops.reshape(self.position, (1,))

    def leaves(self, attn: "MultiheadAttention", k: Tensor) -> tuple[Tensor, Tensor]:
        """The key and value caches of the attention module being built (the current scope)
        for new keys `k` ``[B, H, L, D]``."""
        g = self.graph
        shape = (k.shape[0], attn.head_count, self.capacity, attn.head_width)
        out = []
        for kv in ("k", "v"):
            name = _join(self.prefix, g.current_scope, kv)
            leaf = g.states.get(name)
            if leaf is None:
                leaf = g.state(name, shape, k.dtype)
            elif leaf.shape != shape:
                raise GraphError(f"KVCache: state '{name}' is {fmt_shape(leaf.shape)}, the module "
                                 f"'{g.current_scope}' needs {fmt_shape(shape)}")
            out.append(leaf)
        return out[0], out[1]

    def write(self, cache_k: Tensor, cache_v: Tensor, k: Tensor, v: Tensor) -> None:
        """Store new keys and values at the position (0 in a prefill)."""
        at = self.position if self.position is not None else self.graph.const(np.int64(0))
        self.writes += [ops.cache_write(cache_k, k, at, axis=2), ops.cache_write(cache_v, v, at, axis=2)]


class MultiheadAttention(Module):
    """Multi-head attention with the fused ``qkv_weight [3, C, C]`` and ``qkv_bias [3, C]``.

    ``q = x @ qkv_weight[0] + qkv_bias[0]`` (k and v with 1 and 2), heads split by reshape and
    transpose to ``[B, H, T, D]``, ``softmax(mask(q @ k^T / sqrt(D))) @ v``, heads merged, then
    the ``output`` Linear ``[C, C]`` and ``output_dropout``.

    ``attn(x)`` is causal self-attention (by default); ``attn(x, memory)`` is cross-attention with
    queries from `x` and keys/values from `memory`; ``attn(x, cache=kv)`` is causal self-attention
    that reads and writes a `KVCache` (prefill or one decode step, see there). The pieces are
    public: `project_qkv` / `project_q` / `project_kv` (projections), `split_heads` /
    `merge_heads`, `attend(q, k, v)` (the attention itself), `attend_cached` and `project_output`.
    """

    def __init__(self, channels: int, head_count: int, dropout: float = 0.0, bias: bool = True,
                 causal: bool = True):
        super().__init__()
        _positive("MultiheadAttention", channels=channels, head_count=head_count)
        if channels % head_count:
            raise ValueError(f"MultiheadAttention: channels ({channels}) must be divisible by "
                             f"head_count ({head_count})")
        _check_p("MultiheadAttention", dropout)
        self.channels, self.head_count = int(channels), int(head_count)
        self.head_width = self.channels // self.head_count
        self.causal = bool(causal)
        self.qkv_weight = Parameter((3, channels, channels), _init.uniform(math.sqrt(3.0 / channels)))
        self.qkv_bias = Parameter((3, channels), "zero") if bias else None
        self.output = Linear(channels, channels, bias=bias)
        self.output_dropout = Dropout(dropout)

    # -- projections -------------------------------------------------------------------------------
    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v ``[..., T, C]`` of one source with one batched matmul against ``[3, C, C]``."""
        g = x.graph
        _check_last_dim(self, x, self.channels)
        w = self.bind(g, "qkv_weight")
        rows = ops.reshape(x, (1, x.size // self.channels, self.channels))  # [1, B*T, C]
        qkv = rows @ w                                                       # [3, B*T, C]
        if self.qkv_bias is not None:
            qkv = qkv + ops.reshape(self.bind(g, "qkv_bias"), (3, 1, self.channels))
        return tuple(ops.reshape(qkv[j], x.shape) for j in range(3))

    def project(self, x: Tensor, j: int) -> Tensor:
        """Projection j (0 = query, 1 = key, 2 = value) of `x`: ``x @ W[j] + b[j]``."""
        g = x.graph
        _check_last_dim(self, x, self.channels)
        y = x @ self.bind(g, "qkv_weight")[j]
        if self.qkv_bias is not None:
            y = y + self.bind(g, "qkv_bias")[j]
        return y

    def project_q(self, x: Tensor) -> Tensor:
        return self.project(x, 0)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        return self.project(memory, 1), self.project(memory, 2)

    # -- heads -------------------------------------------------------------------------------------------
    def split_heads(self, t: Tensor) -> Tensor:
        """``[B, T, C] -> [B, H, T, D]``."""
        b, s, _ = t.shape
        return ops.transpose(ops.reshape(t, (b, s, self.head_count, self.head_width)), (0, 2, 1, 3))

    def merge_heads(self, t: Tensor) -> Tensor:
        """``[B, H, T, D] -> [B, T, C]``."""
        b, _, s, _ = t.shape
        return ops.reshape(ops.transpose(t, (0, 2, 1, 3)), (b, s, self.channels))

    # -- attention ----------------------------------------------------------------------------------------
    _captured: list | None = None   # set by `capture_attention`: record the probabilities

    def probabilities(self, q: Tensor, k: Tensor, causal: bool | None = None, offset: int = 0,
                      mask: Tensor | None = None) -> Tensor:
        """The attention probabilities ``softmax(q @ k^T / sqrt(D) [+ mask], causal)``
        ``[B, H, Tq, Tk]`` of ``[B, H, T, D]`` heads (each row sums to 1).

        `causal` (default: the module's) fills ``j > i + offset`` with -inf, so those
        probabilities are exactly 0; `mask` is an optional additive mask broadcast against the
        scores.
        """
        causal = self.causal if causal is None else causal
        scores = (q @ ops.swapaxes(k, -1, -2)) * (1.0 / math.sqrt(self.head_width))
        if mask is not None:
            scores = scores + mask
        if causal:
            scores = ops.causal_mask(scores, offset=offset)
        return ops.softmax(scores, -1)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool | None = None, offset: int = 0,
               mask: Tensor | None = None) -> Tensor:
        """``probabilities(q, k, causal, offset, mask) @ v`` on ``[B, H, T, D]`` heads.

        Plain causal self-attention is one fused ``causal_attention`` node (the same function),
        except under `capture_attention`, which needs the probabilities as a node of their own.
        """
        causal = self.causal if causal is None else causal
        if (self._captured is None and causal and mask is None and offset == 0
                and q.shape == k.shape == v.shape):
            return ops.causal_attention(q, k, v, 1.0 / math.sqrt(self.head_width))
        probs = self.probabilities(q, k, causal, offset, mask)
        if self._captured is not None:
            self._captured.append(probs)
        return probs @ v

    def attend_cached(self, q: Tensor, k: Tensor, v: Tensor, cache: "KVCache") -> Tensor:
        """Causal attention of the new heads ``[B, H, L, D]`` against `cache`, which also gets
        the new keys and values (`KVCache.write`).

        Prefill (``cache.position`` None): the L new positions are all there is, so this is
        `attend` with the causal mask. Decode (L = 1 at ``cache.position``): the query attends to
        the cached keys at positions ``< position`` and to its own key, one softmax over both:
        one ``cached_attention`` node, whose kernels read only the positions in use.
        """
        cache_k, cache_v = cache.leaves(self, k)
        if cache.position is None:
            context = self.attend(q, k, v, causal=True)
        else:
            context = ops.cached_attention(q, k, v, cache_k, cache_v, cache.position,
                                           1.0 / math.sqrt(self.head_width))
        cache.write(cache_k, cache_v, k, v)
        return context

    def project_output(self, context: Tensor) -> Tensor:
        """The output Linear and dropout on merged heads ``[B, T, C]``."""
        return self.output_dropout(self.output(context))

    def forward(self, x: Tensor, memory: Tensor | None = None, cache: "KVCache | None" = None) -> Tensor:
        where = f"MultiheadAttention '{x.graph.current_scope or '<root>'}'"
        for what, t in (("query input", x), ("memory", memory)):
            if t is not None and (t.ndim != 3 or t.shape[-1] != self.channels):
                raise ShapeError(f"{where}: {what} {fmt_shape(t.shape)} must be [B, T, {self.channels}]")
        if cache is not None:
            if memory is not None or not self.causal:
                raise GraphError(f"{where}: a KV cache serves causal self-attention only "
                                 f"({'cross-attention' if memory is not None else 'causal=False'})")
            q, k, v = (self.split_heads(t) for t in self.project_qkv(x))
            return self.project_output(self.merge_heads(self.attend_cached(q, k, v, cache)))
        if memory is None:
            q, k, v = self.project_qkv(x)
        else:
            if memory.shape[0] != x.shape[0]:
                raise ShapeError(f"MultiheadAttention '{x.graph.current_scope or '<root>'}': "
                                 f"batch of memory {fmt_shape(memory.shape)} differs from query "
                                 f"{fmt_shape(x.shape)}")
            q, (k, v) = self.project_q(x), self.project_kv(memory)
        context = self.attend(self.split_heads(q), self.split_heads(k), self.split_heads(v))
        return self.project_output(self.merge_heads(context))

    def extra_repr(self):
        return (f"channels={self.channels}, heads={self.head_count}, causal={self.causal}, "
                f"bias={self.qkv_bias is not None}")


@contextmanager
def capture_attention(module: Module) -> Iterator[dict[str, list[Tensor]]]:
    """Record the attention probabilities of every `MultiheadAttention` under `module`.

    Inside the block, each call of such a module computes its probabilities as graph nodes
    (`MultiheadAttention.probabilities`: matmul, scale, causal_mask, softmax, instead of the
    fused causal_attention op; the same function) and appends that ``[B, H, Tq, Tk]`` tensor to
    the yielded dict under the module's path relative to `module` (``blocks.0.attention``).
    Make them outputs of a program to read them, as PyTorch's ``need_weights=True`` does:

        with nn.capture_attention(model) as probs:
            logits = model(tokens)
        program = executors.compile(g, [logits, *(p for ps in probs.values() for p in ps)])
    """
    found = {path: m for path, m in module.named_modules() if isinstance(m, MultiheadAttention)}
    captured: dict[str, list[Tensor]] = {path: [] for path in found}
    for path, m in found.items():
        object.__setattr__(m, "_captured", captured[path])
    try:
        yield captured
    finally:
        for m in found.values():
            object.__setattr__(m, "_captured", None)


class MLP(Module):
    """Linear -> activation -> ... -> Linear, children ``layers.0``, ``layers.1``, ...

    `activations` has one entry per Linear (None = identity); by default every hidden layer uses
    `activation` and the output layer none.
    """

    def __init__(self, in_features: int, hidden_sizes: Sequence[int], out_features: int,
                 activation="gelu", activations: Sequence | None = None, bias: bool = True,
                 weight_init="xavier_uniform", bias_init="zero"):
        super().__init__()
        sizes = [int(in_features)] + [int(h) for h in hidden_sizes] + [int(out_features)]
        if activations is None:
            activations = [activation] * (len(sizes) - 2) + [None]
        if len(activations) != len(sizes) - 1:
            raise ValueError(f"MLP: {len(sizes) - 1} layers need {len(sizes) - 1} activations, "
                             f"got {len(activations)}")
        self.activations = [get_activation(a) for a in activations]
        self.layers = ModuleList([Linear(a, b, bias, weight_init, bias_init)
                                  for a, b in zip(sizes[:-1], sizes[1:])])

    def forward(self, x: Tensor) -> Tensor:
        for layer, act in zip(self.layers, self.activations):
            x = layer(x)
            if act is not None:
                x = act(x)
        return x


class SwiGLU(Module):
    """``output(silu(gate) * value)`` where ``[gate | value] = input(x)``.

    ``input`` is one Linear ``in -> 2*hidden`` (first `hidden` outputs the gate, the rest the
    value) and ``output`` is ``hidden -> out``.
    """

    def __init__(self, in_features: int, hidden: int, out_features: int | None = None,
                 bias: bool = True):
        super().__init__()
        self.input = Linear(in_features, 2 * hidden, bias)
        self.output = Linear(hidden, out_features or in_features, bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.output(swiglu(self.input(x)))


def make_norm(kind: str, width: int, eps: float) -> Module:
    if kind == "layernorm":
        return LayerNorm(width, eps)
    if kind == "rmsnorm":
        return RMSNorm(width, eps)
    raise ValueError(f"unknown norm {kind!r}; expected 'layernorm' or 'rmsnorm'")


def default_mlp_hidden(mlp: str, channels: int) -> int:
    """The MLP's hidden width when none is given: 4C for GELU (GPT-2); 2C for SwiGLU, whose
    input Linear is then 4C wide (gate and value), so both have 12C^2 + O(C) block weights."""
    return (2 if mlp == "swiglu" else 4) * int(channels)


class DecoderBlock(Module):
    """The pre-norm GPT block of the TensorLib decoder.

    ``r = x + attention(attention_norm(x))``;
    ``y = r + mlp_dropout(mlp_output(act(mlp_input(mlp_norm(r)))))``.
    With hidden width H (`mlp_hidden`; default 4C for GELU, 2C for SwiGLU): ``mlp="gelu"`` has
    mlp_input ``[H, C]`` and mlp_output ``[C, H]``; ``mlp="swiglu"`` has mlp_input ``[2H, C]``
    (rows 0..H-1 the gate, H..2H-1 the value) and mlp_output ``[C, H]``.
    """

    def __init__(self, channels: int, head_count: int, dropout: float = 0.0,
                 layer_norm_epsilon: float = 1e-5, norm: str = "layernorm", mlp: str = "gelu",
                 gelu_approximate: str = "tanh", attention_bias: bool = True, mlp_bias: bool = True,
                 mlp_hidden: int | None = None):
        super().__init__()
        if mlp not in ("gelu", "swiglu"):
            raise ValueError(f"DecoderBlock: mlp must be 'gelu' or 'swiglu', got {mlp!r}")
        if gelu_approximate not in ("tanh", "none"):
            raise ValueError(f"DecoderBlock: gelu_approximate must be 'tanh' or 'none', got {gelu_approximate!r}")
        c = int(channels)
        hidden = default_mlp_hidden(mlp, c) if mlp_hidden is None else mlp_hidden
        _positive("DecoderBlock", mlp_hidden=hidden)
        self.mlp_kind, self.gelu_approximate, self.mlp_hidden = mlp, gelu_approximate, int(hidden)
        self.attention_norm = make_norm(norm, c, layer_norm_epsilon)
        self.attention = MultiheadAttention(c, head_count, dropout, bias=attention_bias)
        self.mlp_norm = make_norm(norm, c, layer_norm_epsilon)
        self.mlp_input = Linear(c, (2 if mlp == "swiglu" else 1) * self.mlp_hidden, mlp_bias)
        self.mlp_output = Linear(self.mlp_hidden, c, mlp_bias)
        self.mlp_dropout = Dropout(dropout)

    def activation(self, h: Tensor) -> Tensor:
        if self.mlp_kind == "swiglu":
            return swiglu(h)
        return ops.gelu(h, self.gelu_approximate)

    def mlp(self, r: Tensor) -> Tensor:
        """The MLP branch (with its norm and dropout) of the residual ``r``."""
        return self.mlp_dropout(self.mlp_output(self.activation(self.mlp_input(self.mlp_norm(r)))))

    def forward(self, x: Tensor, cache: "KVCache | None" = None) -> Tensor:
        """The block on ``x [B, T, C]``; with `cache` its attention reads and writes the KV cache."""
        r = x + self.attention(self.attention_norm(x), cache=cache)
        return r + self.mlp(r)


class TransformerDecoderLayer(Module):
    """The original post-norm decoder layer ("Attention Is All You Need") with cross-attention.

    ``h = self_attention_norm(x + self_attention(x))`` (causal),
    ``h = cross_attention_norm(h + cross_attention(h, memory))`` (queries from the decoder, keys
    and values from the encoder output `memory`, not causal),
    ``y = feed_forward_norm(h + feed_forward(h))`` with a ReLU MLP ``d_model -> d_ff -> d_model``.
    Attention has no biases; the feed-forward has.
    """

    def __init__(self, d_model: int, head_count: int, d_ff: int, dropout: float = 0.0,
                 eps: float = 1e-5, activation="relu"):
        super().__init__()
        _positive("TransformerDecoderLayer", d_model=d_model, head_count=head_count, d_ff=d_ff)
        if d_model % head_count:
            raise ValueError(f"TransformerDecoderLayer: d_model ({d_model}) must be divisible by "
                             f"head_count ({head_count})")
        self.d_model, self.head_count, self.d_ff = int(d_model), int(head_count), int(d_ff)
        self.self_attention = MultiheadAttention(d_model, head_count, dropout, bias=False, causal=True)
        self.self_attention_norm = LayerNorm(d_model, eps)
        self.cross_attention = MultiheadAttention(d_model, head_count, dropout, bias=False, causal=False)
        self.cross_attention_norm = LayerNorm(d_model, eps)
        self.feed_forward = MLP(d_model, [d_ff], d_model, activation=activation, bias=True)
        self.feed_forward_dropout = Dropout(dropout)
        self.feed_forward_norm = LayerNorm(d_model, eps)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        h = self.self_attention_norm(x + self.self_attention(x))
        h = self.cross_attention_norm(h + self.cross_attention(h, memory))
        return self.feed_forward_norm(h + self.feed_forward_dropout(self.feed_forward(h)))

    def extra_repr(self):
        return f"d_model={self.d_model}, heads={self.head_count}, d_ff={self.d_ff}"


__all__ = ["Parameter", "Module", "ModuleList", "Linear", "Embedding", "PositionalEmbedding",
           "LayerNorm", "RMSNorm", "Dropout", "KVCache", "MultiheadAttention", "MLP", "SwiGLU",
           "DecoderBlock", "TransformerDecoderLayer", "swiglu", "ACTIVATIONS", "get_activation",
           "dropout_key", "DROPOUT_KEY", "make_norm", "default_mlp_hidden", "capture_attention"]
