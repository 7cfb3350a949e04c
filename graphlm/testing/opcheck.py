"""`check_op`: everything one op (a custom op, typically) must satisfy, on given inputs.

1. its derivatives up to `order` against float64 central differences (`check_grads`);
2. where the op has both a decomposition and a kernel: the kernel against the decomposition,
   on the float64 copy (a right VJP over a wrong kernel shows here, naming the executor);
3. every usable executor against the reference, in the inputs' own dtypes
   (`assert_executors_agree`).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

import graphlm as gl
from graphlm.registry import get_op
from graphlm.rewrite import copy_graph

from .agree import assert_executors_agree, usable_executors
from .gradcheck import TO_FLOAT64, GradCheckResult, check_grads
from .graphs import assert_close, build, compile, feeds_of, is_float

DECOMPOSITION_RTOL = 1e-10   # kernel vs decomposition, both float64


def check_op(name: str, args: Sequence, attrs: Mapping | None = None, *, order: int = 2,
             executors: Sequence[str] | None = None, seed: int = 0) -> GradCheckResult | None:
    """Check op `name` applied to `args` (arrays) with `attrs`: its gradients (when it is
    differentiable and has a float input), its kernels against its decomposition, and every
    executor against the reference. Returns the gradient check's result, if one ran."""
    op = get_op(name)
    attrs = dict(attrs or {})
    arrays = [np.asarray(a) for a in args]

    def f(*xs):
        return gl.apply(name, list(xs), **attrs)
    f.__name__ = name

    result = None
    g, _, out = build(f, arrays, name=f"check_op({name})")
    if op.differentiable and out.dtype.kind == "f" and any(is_float(a) for a in arrays):
        result = check_grads(f, arrays, order=order, seed=seed)
    names = usable_executors() if executors is None else list(executors)
    if op.decompose is not None:
        g64, new = copy_graph([out], dtypes=TO_FLOAT64)
        fed = {k: a.astype(np.float64) if is_float(a) else a for k, a in feeds_of(arrays).items()}
        node = new[out.id]
        composed = op.decompose(*node.inputs, **node.attrs)
        (want,) = compile(g64, [composed]).run(fed)
        for executor in dict.fromkeys(["reference", *names]):
            program = compile(g64, [node], executor)
            if program.graph is not g64:
                continue        # no kernel here: it ran the decomposition itself
            (got,) = program.run(fed)
            assert_close(got, want, DECOMPOSITION_RTOL, DECOMPOSITION_RTOL,
                         f"check_op: the {executor} kernel of op '{name}' disagrees with the op's "
                         "decomposition (float64)")
    assert_executors_agree(g, [out], feeds_of(arrays), executors=names)
    return result
