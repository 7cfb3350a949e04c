"""Pass `kept_values`: a forward op keeps what its backward would recompute, as a tensor of the
graph (its producer, its readers and its lifetime are the memory plan's like any other value).
`KEPT_STATISTICS` is the pass without the GELU's rules (the native executor's: below).

- the tanh GELU whose input also feeds a ``gelu_backward``: ``gelu(x)`` -> ``x * s`` with
  ``s = gelu_sigmoid(x)``, and ``gelu_backward(x, g)`` -> ``gelu_backward_sigmoid(x, g, s)`` (no
  exp recomputed; the same arithmetic, bit for bit). float32 only, as the numpy executor's
  kernels are written for it. (s is its own node, not a second half of the GELU's buffer: the
  GELU's output then dies at its last reader, not at the backward.)
- a layer norm whose input also feeds a ``layer_norm_backward`` (same eps) or a plain
  ``layer_norm(x)`` (the normalised input of the weight gradient): the first forward becomes
  ``layer_norm_keep`` (flat: y, xc = x - mean, sv = sqrt(var + eps), and xhat = xc / sv when a
  plain one reads it), whose parts are views; the backward becomes
  ``layer_norm_backward_kept(xc, sv, [w], g)`` (4 of its 17 passes saved) and the plain layer
  norm the xhat view (`KEPT_STATISTICS`: ``div(xc, sv)``, no xhat kept). Those nodes no longer
  read x, so x's buffer can die at the forward.
- a causal attention whose output feeds its own ``causal_attention_backward`` (the VJP gives it
  the forward's output): ``causal_attention_keep`` (flat: y, the scores E = exp(s - rowmax) in
  query blocks, the row sums l; views) and ``causal_attention_backward_kept(q, k, v, y, E, l, g)``,
  which recomputes no score. Only where the kept scores cost at most KEEP_SCORES_PER_OUTPUT
  elements per element of the attention's output (about T / 2D: TinyLM's T = 128, D = 32 keeps
  3x its output; GPT-2 small's T = 1024, D = 64 would keep 8.5x, 1.3 GB at batch 4): past that
  the backward recomputes the scores (a sixth more attention products) instead of holding them.
"""
from __future__ import annotations

import functools

from graphlm import ops
from graphlm.ops import causal_attention_keep_layout, layer_norm_keep_layout

from .rewrite import Pass, Rule

KEEP_SCORES_PER_OUTPUT = 4   # kept score elements per attention output element, at most


def _tanh_gelu(node) -> bool:
    return node.attrs["approximate"] == "tanh" and node.dtype.name == "float32"


def _gelu(node, ctx):
    x = node.inputs[0]
    if not _tanh_gelu(node) or not any(r.op == "gelu_backward" and _tanh_gelu(r) and r.inputs[0] is x
                                       and r.id > node.id for r in ctx.readers(x)):
        return None
    s = ctx.memo[("gelu sigmoid", x.id)] = ctx.emit("gelu_sigmoid", (ctx.new(x),), kept=True)
    return ctx.emit("mul", (ctx.new(x), s))


def _gelu_backward(node, ctx):
    x, g = node.inputs
    s = ctx.memo.get(("gelu sigmoid", x.id))
    if s is None or not _tanh_gelu(node):
        return None
    return ctx.emit("gelu_backward_sigmoid", (ctx.new(x), ctx.new(g), s))


def _plain(node) -> bool:
    return node.op == "layer_norm" and not node.attrs.get("has_weight") and not node.attrs.get("has_bias")


def _layer_norm(node, ctx, keeps_xhat: bool):
    x, eps = node.inputs[0], node.attrs["eps"]
    kept = ctx.memo.get(("layer norm", x.id, eps))
    if kept is not None:   # a later plain layer norm of the same input: the kept xhat, or xc / sv
        if not _plain(node):
            return None
        return kept["xhat"] if "xhat" in kept else ctx.emit("div", (kept["xc"], kept["sv"]))
    if node.is_backward:
        return None
    users = [r for r in ctx.readers(x) if r.id > node.id and r.inputs[0] is x and r.attrs.get("eps") == eps
             and (r.op == "layer_norm_backward" or _plain(r))]
    if not users:
        return None
    keep_xhat = keeps_xhat and any(_plain(u) for u in users)
    flat = ctx.emit("layer_norm_keep", [ctx.new(i) for i in node.inputs], **node.attrs, keep_xhat=keep_xhat)
    parts = {name: ctx.emit_part(flat, a, b, sh, name != "y") for name, a, b, sh in layer_norm_keep_layout(x.shape, keep_xhat)}
    ctx.memo[("layer norm", x.id, eps)] = parts
    return parts["y"]


def _layer_norm_backward(node, ctx):
    x, eps = node.inputs[0], node.attrs["eps"]
    kept = ctx.memo.get(("layer norm", x.id, eps))
    if kept is None:
        return None
    rest = [ctx.new(i) for i in node.inputs[1:]]   # [w], g
    return ctx.emit("layer_norm_backward_kept", [kept["xc"], kept["sv"], *rest], eps=eps,
                    has_weight=bool(node.attrs.get("has_weight")))


def _own_attention_backward(fwd, back) -> bool:
    """Whether `back` is the causal_attention_backward of the forward node `fwd` itself."""
    return (back.op == "causal_attention_backward" and back.inputs[3] is fwd and back.attrs == fwd.attrs
            and all(a is b for a, b in zip(back.inputs[:3], fwd.inputs)))


def keeps_scores(shape, query_block: int | None = None) -> bool:
    """Whether a causal attention of q's `shape` keeps its scores for its backward: E costs at
    most KEEP_SCORES_PER_OUTPUT elements per element of the output."""
    (_, _, y_size, _), (_, e0, e1, _) = causal_attention_keep_layout(shape, query_block)[:2]
    return e1 - e0 <= KEEP_SCORES_PER_OUTPUT * y_size


def _attention(node, ctx):
    if not any(_own_attention_backward(node, r) for r in ctx.readers(node)):
        return None
    query_block = ops.ATTENTION_QUERY_BLOCK   # (read now: tests vary it)
    if not keeps_scores(node.shape, query_block):
        return None
    flat = ctx.emit("causal_attention_keep", [ctx.new(i) for i in node.inputs], scale=node.attrs["scale"],
                    query_block=query_block)
    parts = {name: ctx.emit_part(flat, a, b, sh, name != "y")
             for name, a, b, sh in causal_attention_keep_layout(node.shape, query_block)}
    ctx.memo[("attention", node.id)] = parts, query_block
    return parts["y"]


def _attention_backward(node, ctx):
    fwd = node.inputs[3]
    kept = ctx.memo.get(("attention", fwd.id))
    if kept is None or not _own_attention_backward(fwd, node):
        return None
    parts, query_block = kept
    q, k, v = (ctx.new(i) for i in node.inputs[:3])
    return ctx.emit("causal_attention_backward_kept", (q, k, v, parts["y"], parts["e"], parts["l"],
                                                       ctx.new(node.inputs[4])),
                    scale=node.attrs["scale"], query_block=query_block)


_GELU_RULES = (
    Rule("tanh GELU with its backward", ("gelu",), _gelu),
    Rule("tanh GELU backward from the kept sigmoid", ("gelu_backward",), _gelu_backward),
)


def _statistics_rules(keeps_xhat: bool) -> tuple[Rule, ...]:
    """The layer norm's and the attention's rules; with keeps_xhat False the weight gradient's
    plain layer norm becomes xc / sv instead of a kept xhat."""
    return (
        Rule("layer norm with its backward", ("layer_norm",), functools.partial(_layer_norm, keeps_xhat=keeps_xhat)),
        Rule("layer norm backward from the kept statistics", ("layer_norm_backward",), _layer_norm_backward),
        Rule("causal attention with its backward", ("causal_attention",), _attention),
        Rule("causal attention backward from the kept scores", ("causal_attention_backward",), _attention_backward),
    )


_STATISTICS_DOC = ("layer_norm(x) + layer_norm_backward(x, g) -> layer_norm_keep(x) parts + "
                   "layer_norm_backward_kept(xc, sv, g); causal_attention + its backward -> causal_attention_keep "
                   "parts + causal_attention_backward_kept(.., y, E, l, g)")

KEPT_VALUES = Pass("kept_values", _GELU_RULES + _statistics_rules(keeps_xhat=True),
                   doc="gelu(x) + gelu_backward(x, g) -> x * s + gelu_backward_sigmoid(x, g, s), s = gelu_sigmoid(x); "
                       + _STATISTICS_DOC)

# The native executor's: the same pass without the GELU's rules, as its GELU backward recomputes
# s in the one pass that reads x and g (the C exp: cheaper than writing s in the forward, reading it
# back there and in the backward, and holding it between them); and with no xhat kept: the weight
# gradient's plain layer norm becomes xc / sv, which the affine_grads pass then divides where its
# C kernel reads xc (one array fewer written by the forward and held until the backward). The same
# bits: s and xhat are computed the same way in either place.
KEPT_STATISTICS = Pass("kept_values", _statistics_rules(keeps_xhat=False),
                       doc=_STATISTICS_DOC + " (the GELU recomputes its sigmoid; a plain layer norm of x is xc / sv)")
