"""In-place and view capability, each stated once. Views: graphlm/ops.py's view flag, applied by
graphlm/layout.py. In place: one source, the numpy executor's kernel table (executors/numpy): each
kernel that says it may write its output over input p must compute the same bytes with its
output array being input p's array as with an output of its own, for every op row of
tests/test_ops.py that uses it."""
from __future__ import annotations

import numpy as np
import pytest

from graphlm import executors
from graphlm.executors.numpy import KERNELS
from tests.gradcheck import build, feeds_of
from tests.test_ops import CASES, inputs_of

INPLACE_OPS = sorted(op for op, k in KERNELS.items() if callable(k.inplace) or k.inplace)


def _positions(kernel, node):
    return tuple(kernel.inplace(node) if callable(kernel.inplace) else kernel.inplace)


@pytest.mark.parametrize("op", INPLACE_OPS)
def test_a_kernel_that_claims_in_place_computes_in_place(op):
    kernel, checked = KERNELS[op], 0
    for case in CASES:
        for k in range(len(case.inputs)):
            arrays = inputs_of(case, k)
            g, _, _ = build(case.f, arrays)
            for node in [n for n in g.nodes if n.op == op][:1]:
                program = executors.get("reference").compile(g, list(node.inputs))
                ins = program.run({k: v for k, v in feeds_of(arrays).items() if k in program.input_nodes})

                def computed(out, arrays_in, p):
                    specs = kernel.scratch(node, p) if kernel.scratch else []
                    kernel.build(node, out, arrays_in, [np.empty(sp[0], sp[1]) for sp in specs])()
                    return out

                want = computed(np.empty(node.shape, node.dtype), [np.array(a, copy=True) for a in ins], None)
                for p in _positions(kernel, node):
                    if ins[p].shape != node.shape or ins[p].dtype != node.dtype:
                        continue   # (the planner shares only an input of the output's shape and dtype)
                    arrays_in = [np.array(a, copy=True) for a in ins]
                    got = computed(arrays_in[p], arrays_in, p)
                    assert got.tobytes() == want.tobytes(), f"{op} ({case.name}-{k}) in place of input {p}"
                    checked += 1
    if op != "layer_norm_backward_kept":   # (executor-private: made by the numpy executor's own passes)
        assert checked, f"no row of tests/test_ops.py CASES runs {op} in place; add one"


def test_every_registered_view_op_is_applied_as_a_view():
    import graphlm as gl
    from graphlm.layout import apply_view, stand_in
    from graphlm.registry import REGISTRY
    g = gl.Graph("views")
    x = g.input("x", (2, 3, 4))
    made = {"reshape": gl.reshape(x, (6, 4)), "transpose": gl.transpose(x, (2, 0, 1)),
            "broadcast_to": gl.broadcast_to(x[:, :1], (2, 5, 4)), "slice": x[:, 1:]}
    assert set(made) == {name for name, op in REGISTRY.items() if op.view}, "a new view op needs a row here"
    for name, node in made.items():
        node = node if node.op == name else next(n for n in g.nodes if n.op == name)
        src = stand_in(node.inputs[0].shape, node.inputs[0].dtype)
        view = apply_view(node, src)
        assert view.shape == node.shape and np.shares_memory(view, src) or view.size == 0
