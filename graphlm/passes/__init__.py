"""Graph-level passes: rewrites of a graph into an equivalent graph of registered ops.

- rewrite.py: the mechanism, and graphlm's only graph copier (graphlm/rewrite.py's dtype change
  and decomposition expansion are rule tables it runs). A `Rule` looks at one node (of the ops it names) with its inputs and
  their consumer counts and returns a replacement built in the new graph, or None; a `Pass` is a
  named list of rules; `rewrite` runs one pass over a graph and `run_pipeline` a named list of
  passes, each returning the rewritten graph, its outputs and a map from every source node to
  what replaced it (`Rewritten`).
- one file per pass, each a rule table: matmul_sum.py (a batched product's weight gradient as
  one product), slice_gradients.py (the QKV gradient in one node), attention_softmax.py
  (attention's scale and causal mask folded into softmax), dropout_masks.py (one keep mask, a
  tensor, shared by a dropout and its backward), kept_values.py (what a tanh GELU, a layer norm
  and a causal attention keep for their backward, as tensors of the graph), transposed_weights.py
  (a product with a param's transpose reads the transpose as a param of its own) and
  panel_weights.py (a product with a param reads it in column panels, its bias added in the
  product): the weight layouts of the Generator, whose params stay fixed; in no pipeline;
  affine_grads.py (a layer norm's weight and bias gradients in one node),
  residual_norm_backward.py (a residual gradient added where a layer norm's backward writes), bias_dropout_add.py
  (a residual update after an output projection in one node), bias_gelu.py (an MLP's first bias
  added where its GELU and the GELU's backward read it), merged_heads.py (attention
  stores its results with the heads merged: the merge and the QKV gradient's assembly become
  views) and matmul_accumulate.py (the QKV input gradient's three products added as stored):
  the native pipeline's, for its C kernels.
- pipelines.py: `PIPELINES`, the passes each executor runs (an executor names its pipeline).

Every op a pass produces is registered in graphlm/ops.py ("ops the graph passes produce"; the
attention pair beside causal_attention) with
its shape rule, decomposition and doc, so the reference executor runs a rewritten graph and
autodiff differentiates it. Passes import the front end only (never an executor).
"""
from __future__ import annotations

from .pipelines import PIPELINES, pipeline_of, run_pipeline
from .rewrite import ANY, Context, Pass, Rewritten, Rule, rewrite

__all__ = ["ANY", "Context", "PIPELINES", "Pass", "Rewritten", "Rule", "pipeline_of", "rewrite", "run_pipeline"]
