"""graphlm: build a static graph of ops, differentiate it, run it with an executor.

    import graphlm as gl
    g = gl.Graph()
    x = g.input("x", (4, 3)); w = g.param("w", (3, 2))
    loss = gl.mean(gl.tanh(x @ w))
    (dw,) = gl.grad(loss, [w])
"""
from . import ir as _ir
from . import ops
from .ir import Graph, GraphError, ShapeError, Tensor
from .autodiff import grad, vjp
from .registry import REGISTRY, OpDef, apply, get_op, register_op, unregister_op
from .ops import (add, broadcast_to, cast, cached_attention, causal_attention, causal_mask, concat, cross_entropy,
                  div, dropout, embedding, equal, erf, exp, gelu, greater, layer_norm, less, log,
                  log_softmax, matmul, max, maximum, mean, mul, neg, one_hot, pow, relu, reshape,
                  rms_norm, rsqrt, sigmoid, silu, slice, softmax, split, sqrt, square, sub, sum,
                  swapaxes, tanh, transpose, where)

_ir._ops = ops

from . import init, nn  # noqa: E402  (modules: build on the ops above)
from .models import GPT, GPTConfig  # noqa: E402

__version__ = "0.1.0"
