"""Memory layouts of a graph's values under NumPy strides: which view ops (reshape, transpose,
broadcast_to, slice) really are views of their input, found by applying them to zero-cost
stand-in arrays. The front end's passes and the numpy executor's planner both ask here.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .ir import Tensor
from .registry import REGISTRY



def apply_view(node: Tensor, arr: np.ndarray) -> np.ndarray:
    """The view `node` takes of `arr` (its input's array). Raises ValueError when the op would
    need a copy (a reshape of data whose strides do not allow it)."""
    op = node.op
    if op == "reshape":
        return np.reshape(arr, node.shape, copy=False)
    if op == "transpose":
        return arr.transpose(node.attrs["axes"])
    if op == "broadcast_to":
        return np.broadcast_to(arr, node.shape)
    if op == "slice":
        return arr[tuple(node.attrs["index"]) + (Ellipsis,)]   # (Ellipsis: a 0-d result stays a view)
    raise NotImplementedError(f"{op} is registered as a view op but graphlm/layout.py cannot apply it")


def address(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]





def stand_in(shape, dtype, strides=None) -> np.ndarray:
    """A zero-cost stand-in array with the given layout, to ask NumPy whether a view is possible."""
    dtype = np.dtype(dtype)
    if strides is None:  # C-contiguous
        st, acc = [], dtype.itemsize
        for d in reversed(shape):
            st.append(acc)
            acc *= max(int(d), 1)
        strides = tuple(reversed(st))
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, strides, writeable=False)


def reshapes_as_view(arr: np.ndarray, shape) -> bool:
    """Whether `arr` reshapes to `shape` without a copy."""
    try:
        np.reshape(arr, shape, copy=False)
        return True
    except ValueError:
        return False


def layouts(nodes: Sequence[Tensor]):
    """Decide which view nodes are views, by applying them to stand-in arrays of the right strides.

    Returns (protos, root_of, view_offset, is_view): a stand-in array per node, the non-view node
    whose memory each node lives in, the byte offset of a view's data from its root's start, and
    the set of view node ids. Leaves and computed nodes are assumed C-contiguous.
    """
    protos: dict[int, np.ndarray] = {}
    root_of: dict[int, int] = {}
    view_offset: dict[int, int] = {}
    is_view: set[int] = set()
    for n in nodes:
        op = REGISTRY.get(n.op)   # (None: an executor-private fused op, never a view)
        if op is not None and op.view:   # (graphlm/ops.py says which ops are views; apply_view says how)
            src = n.inputs[0]
            try:
                p = apply_view(n, protos[src.id])
            except ValueError:
                p = None
            if p is not None:
                protos[n.id] = p
                root_of[n.id] = root_of[src.id]
                view_offset[n.id] = view_offset[src.id] + address(p) - address(protos[src.id])
                is_view.add(n.id)
                continue
        protos[n.id] = stand_in(n.shape, n.dtype)
        root_of[n.id] = n.id
        view_offset[n.id] = 0
    return protos, root_of, view_offset, is_view
