"""The pass pipelines executors run: `PIPELINES[name]` is a tuple of passes, in order. An executor's
program names its pipeline (`pipeline = "numpy"`, "native"); `run_pipeline` applies one to a graph."""
from __future__ import annotations

from typing import Sequence

from graphlm.ir import Graph, Tensor

from .affine_grads import AFFINE_GRADS
from .attention_softmax import ATTENTION_SOFTMAX
from .bias_dropout_add import BIAS_DROPOUT_ADD
from .bias_gelu import BIAS_GELU
from .dropout_masks import DROPOUT_MASKS
from .kept_values import KEPT_STATISTICS, KEPT_VALUES
from .matmul_accumulate import MATMUL_ACCUMULATE
from .matmul_sum import MATMUL_SUM
from .merged_heads import MERGED_HEADS
from .residual_norm_backward import RESIDUAL_NORM_BACKWARD
from .rewrite import Pass, Rewritten, compose, needed, rewrite
from .slice_gradients import SLICE_GRADIENTS

_PLANNED = (MATMUL_SUM, SLICE_GRADIENTS, ATTENTION_SOFTMAX, DROPOUT_MASKS)   # both planned executors' first passes

PIPELINES: dict[str, tuple[Pass, ...]] = {
    "none": (),
    "numpy": _PLANNED + (KEPT_VALUES,),
    # kept_values without the GELU's sigmoid (kept_values.py says why); then six rewrites for C kernels
    "native": _PLANNED + (KEPT_STATISTICS, MATMUL_ACCUMULATE, AFFINE_GRADS, RESIDUAL_NORM_BACKWARD,
                          BIAS_DROPOUT_ADD, BIAS_GELU, MERGED_HEADS),
}


def pipeline_of(name_or_passes) -> tuple[Pass, ...]:
    """The passes of a pipeline name (or the passes given)."""
    if isinstance(name_or_passes, str):
        try:
            return PIPELINES[name_or_passes]
        except KeyError:
            raise ValueError(f"unknown pass pipeline {name_or_passes!r}; known: {', '.join(sorted(PIPELINES))}") from None
    return tuple(name_or_passes)


def run_pipeline(name_or_passes, graph: Graph, outputs: Sequence[Tensor]) -> Rewritten:
    """`graph` (the part `outputs` need) after every pass of the pipeline, in order, with the map
    from each source node to what replaced it. An empty pipeline copies nothing: the source graph."""
    outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    passes = pipeline_of(name_or_passes)
    if not passes:
        return Rewritten(graph, outputs, {n.id: n for n in needed(outputs)}, ())
    done = None
    for p in passes:
        step = rewrite(done.graph if done else graph, done.outputs if done else outputs, p)
        done = step if done is None else compose(done, step)
    return done
