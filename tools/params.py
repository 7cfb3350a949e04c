"""Parameter counts by module, and the analytic FLOPs of a GPT per token.

    from graphlm.tools.params import parameter_table, flops_per_token
    table = parameter_table(graph)        # any graph: its params, grouped by module path
    print(table.format(depth=2))          # a tree: name, shape, parameters, share, bytes
    flops_per_token(config)               # {"forward": ..., "train_step": ...}

A parameter is one `param` leaf of the graph, so a weight shared by two modules (a tied
embedding and head) is counted once; the table marks it with the modules that read it.
Building a graph allocates no parameter arrays, so GPT-2 small is counted without 124M floats.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from graphlm.ir import Graph, fmt_shape

from .folding import Repeat, name_repeats
from .stats import fmt_bytes, module_levels, node_kind, shared_params


@dataclass
class Row:
    """One line of the table: a module (summed over everything below it) or a parameter."""

    name: str                  # full dotted path
    kind: str                  # "module" or "param"
    level: int                 # indentation: 0 for top-level modules and root params
    params: int
    bytes: int
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    shared_with: list[str] = field(default_factory=list)   # other modules reading this weight
    tensors: int = 1

    @property
    def short(self) -> str:
        """The name relative to the parent row (``weight`` under ``blocks.0.attention_norm``)."""
        if self.kind == "module":
            levels = module_levels(self.name)
            parent = levels[-2] if len(levels) > 1 else ""
        else:
            parent = _module_of(self.name)
        return self.name[len(parent) + 1:] if parent else self.name


def _module_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


@dataclass
class ParamTable:
    rows: list[Row]
    total: int
    total_bytes: int
    tensors: int
    shared: dict[str, list[str]]

    def share(self, row: Row) -> float:
        return row.params / self.total if self.total else 0.0

    def module(self, name: str) -> Row:
        for r in self.rows:
            if r.name == name and r.kind == "module":
                return r
        raise KeyError(f"no module '{name}' in the parameter table")

    def to_dict(self, depth: int | None = None) -> dict[str, Any]:
        return {
            "total_parameters": self.total,
            "total_bytes": self.total_bytes,
            "tensors": self.tensors,
            "shared": self.shared,
            "rows": [{"name": r.name, "kind": r.kind, "level": r.level,
                      "shape": list(r.shape) if r.shape is not None else None,
                      "dtype": r.dtype, "parameters": r.params, "share": self.share(r),
                      "bytes": r.bytes, "shared_with": r.shared_with}
                     for r in self.rows if depth is None or r.level <= depth],
        }

    def repeats(self) -> list[Repeat]:
        """Runs of identical sibling modules (same relative parameter names, shapes, dtypes)."""
        return name_repeats((r.name, (r.shape, r.dtype)) for r in self.rows if r.kind == "param")

    def format(self, depth: int | None = None, fold: bool = True) -> str:
        """The tree table. `depth`: show rows down to this level (deeper ones are summed in);
        `fold`: print a run of identical modules once (``blocks.0-11 x12``, the run's total,
        one member's rows under it)."""
        repeats = self.repeats() if fold else []
        later = {m for r in repeats for m in r.members[1:]}
        first = {r.first: r for r in repeats}

        def hidden(row: Row) -> bool:
            return any(row.name == m or row.name.startswith(m + ".") for m in later)

        rows, names = [], []
        for r in self.rows:
            if (depth is not None and r.level > depth) or hidden(r):
                continue
            rep = first.get(r.name) if r.kind == "module" else None
            if rep is not None:
                total = sum(self.module(m).params for m in rep.members)
                nbytes = sum(self.module(m).bytes for m in rep.members)
                r = Row(rep.label, "module", r.level, total, nbytes, tensors=r.tensors * rep.count)
                names.append("  " * r.level + f"{rep.label} (each {total // rep.count:,})")
            else:
                names.append("  " * r.level + r.short + (" *" if r.shared_with else ""))
            rows.append(r)
        shapes = [fmt_shape(r.shape) if r.shape is not None else "" for r in rows]
        w_name = max([len("name")] + [len(n) for n in names])
        w_shape = max([len("shape")] + [len(s) for s in shapes])
        w_num = max(len(f"{self.total:,}"), len("parameters"))
        head = f"{'name':<{w_name}}  {'shape':<{w_shape}}  {'parameters':>{w_num}}  {'share':>7}  {'bytes':>10}"
        out = [head, "-" * len(head)]
        for r, name, shape in zip(rows, names, shapes):
            out.append(f"{name:<{w_name}}  {shape:<{w_shape}}  {r.params:>{w_num},}  "
                       f"{100 * self.share(r):>6.2f}%  {fmt_bytes(r.bytes):>10}")
        out.append("-" * len(head))
        out.append(f"{'total':<{w_name}}  {'':<{w_shape}}  {self.total:>{w_num},}  {100.0:>6.2f}%  "
                   f"{fmt_bytes(self.total_bytes):>10}")
        out.append(f"{self.total:,} parameters in {self.tensors} tensors, "
                   f"{fmt_bytes(self.total_bytes)}")
        for rep in repeats:
            out.append(f"{rep.label}: {rep.count} identical modules, the rows under it are "
                       f"{rep.first}'s (--unfold prints each)")
        for name, modules in self.shared.items():
            out.append(f"* {name} is shared by {', '.join(m or '<root>' for m in modules)} "
                       "(tied; counted once)")
        return "\n".join(out)


def parameter_table(source) -> ParamTable:
    """The parameter tree of a `Graph` (its `param` leaves), of a `graphlm.nn.Module` (its
    declared parameters: no arrays are made) or of a mapping name -> shape (or name -> (shape,
    dtype)). A parameter reachable under two names (a tied head) is one row, marked shared."""
    shared: dict[str, list[str]] = {}
    if isinstance(source, Graph):
        graph = source
        specs = [(name, t.shape, np.dtype(t.dtype)) for name, t in graph.params.items()]
        shared = shared_params(graph)
    elif isinstance(source, Mapping):
        specs = []
        for name, spec in source.items():
            if isinstance(spec, tuple) and len(spec) == 2 and not isinstance(spec[1], (int, np.integer)):
                shape, dtype = spec
            else:
                shape, dtype = spec, np.float32
            specs.append((str(name), tuple(int(d) for d in shape), np.dtype(dtype)))
    elif hasattr(source, "parameters") and hasattr(source, "named_modules"):
        # a graphlm.nn Module: declared shapes only, no arrays, no graph
        specs = [(name, p.shape, np.dtype(p.dtype)) for name, p in source.parameters().items()]
        shared = module_shared_params(source)
    else:
        raise TypeError(f"parameter_table: expected a graphlm Graph, a mapping of shapes or a "
                        f"model, got {type(source).__name__}")

    rows: list[Row] = []
    modules: dict[str, Row] = {}
    total = total_bytes = 0
    for name, shape, dtype in specs:
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * dtype.itemsize
        total += count
        total_bytes += nbytes
        levels = module_levels(_module_of(name))
        for lv, path in enumerate(levels):
            row = modules.get(path)
            if row is None:
                row = modules[path] = Row(path, "module", lv, 0, 0, tensors=0)
                rows.append(row)
            row.params += count
            row.bytes += nbytes
            row.tensors += 1
        rows.append(Row(name, "param", len(levels), count, nbytes, tuple(shape), str(dtype),
                        [m for m in shared.get(name, []) if not name.startswith(m + ".")]))
    return ParamTable(rows, total, total_bytes, len(specs), shared)


def module_shared_params(model) -> dict[str, list[str]]:
    """Parameter name -> the modules holding it, for parameters held by more than one module
    (a tied head holds the embedding's weight). The name is the first one `parameters()` uses."""
    holders: dict[int, list[str]] = {}
    first: dict[int, str] = {}
    for path, module in model.named_modules():
        for attr, value in vars(module).items():
            if type(value).__name__ == "Parameter" and hasattr(value, "shape"):
                holders.setdefault(id(value), []).append(path)
                first.setdefault(id(value), f"{path}.{attr}" if path else attr)
    return {first[k]: sorted(set(v)) for k, v in holders.items() if len(set(v)) > 1}


def model_graph(model, batch_size: int = 1, seq_len: int = 1) -> Graph:
    """The forward graph of a GPT-style model on a tokens input (nodes only, no arrays)."""
    graph = Graph(f"{type(model).__name__.lower()}_forward")
    tokens = graph.input("tokens", (batch_size, seq_len), "int64")
    model(tokens)
    return graph


# -- FLOPs --------------------------------------------------------------------------------------------
def flops_per_token(config, seq_len: int | None = None) -> dict[str, Any]:
    """Analytic FLOPs per token of a GPT forward pass and of a training step.

    Counts the matrix products (a multiply-add is 2 FLOPs), which are all but a few percent of
    the work; norms, activations, softmax and the optimizer's per-parameter update are left
    out. Per layer and token: QKV 6C^2, attention scores and weighted values 4*T*C (the full
    T x T products, the usual convention for MFU; the numpy executor's causal attention skips
    the blocks above the diagonal), output projection 2C^2, MLP 4CF for a GELU MLP of hidden
    width F (16C^2 at the default F = 4C) and 6CF for SwiGLU (its input is 2F wide; 12C^2 at the
    default F = 2C); the head 2CV. A training step is the forward plus a backward that computes two products
    (input and weight gradients) for each forward one: 3x the forward.
    """
    C, V, L = config.channels, config.vocab_size, config.layer_count
    T = config.context_length if seq_len is None else int(seq_len)
    F = config.mlp_width
    mlp = (6 if config.mlp == "swiglu" else 4) * C * F
    per_layer = {"qkv": 6 * C * C, "attention": 4 * T * C, "attention_output": 2 * C * C,
                 "mlp": mlp}
    layer = sum(per_layer.values())
    forward = L * layer + 2 * C * V
    return {"seq_len": T, "per_layer": per_layer, "layers": L * layer, "head": 2 * C * V,
            "forward": forward, "backward": 2 * forward, "train_step": 3 * forward}


def matmul_flops(graph: Graph, kinds=("forward", "backward")) -> dict[str, int]:
    """The FLOPs of the graph's matrix products, counted from node shapes, by node kind: matmul
    nodes, and the products inside fused causal attention (2 forward, 4 backward, each
    2*T*T*D per matrix, full T x T as in `flops_per_token`)."""
    attention_products = {"causal_attention": 2, "causal_attention_keep": 2, "causal_attention_backward": 4,
                          "causal_attention_backward_kept": 4}
    out = {k: 0 for k in kinds}
    for n in graph.nodes:
        kind = node_kind(n)
        if kind not in out:
            continue
        if n.op == "matmul":
            a = n.inputs[0]
            k = a.shape[-1] if a.ndim else 1
            out[kind] += 2 * int(np.prod(n.shape, dtype=np.int64)) * int(k)
        elif n.op in attention_products:
            q = n.inputs[0]
            matrices = int(np.prod(q.shape[:-2], dtype=np.int64))
            out[kind] += attention_products[n.op] * 2 * matrices * q.shape[-2] ** 2 * q.shape[-1]
    return out


def format_flops(flops: dict[str, Any]) -> str:
    def si(x: float) -> str:
        for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
            if x >= size:
                return f"{x / size:.2f} {unit}FLOP"
        return f"{x:.0f} FLOP"

    return (f"FLOPs per token at sequence length {flops['seq_len']}: forward {si(flops['forward'])} "
            f"({flops['forward']:,}), training step {si(flops['train_step'])} "
            f"({flops['train_step']:,}; forward + backward = 3x forward, matmuls only)")


__all__ = ["parameter_table", "ParamTable", "Row", "model_graph", "flops_per_token",
           "matmul_flops", "format_flops"]
