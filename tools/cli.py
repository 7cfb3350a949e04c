"""The `graphlm` command: render, params, plan, stats, train, generate, attention.

    graphlm render --preset tinylm --graph forward --depth 1 --out tinylm.svg
    graphlm params --preset gpt2-small
    graphlm plan --preset tinylm --batch-size 8 --out arena.svg
    graphlm stats --preset tinylm --graph train

A model comes from ``--preset NAME`` or ``--config JSON`` (a file, or the JSON text itself; it
may name a ``"preset"`` and override some of its fields). Errors are one line on stderr and a
non-zero exit: 2 for bad arguments or input, 1 when the work itself fails, 3 when Graphviz is
missing (the .dot file is written anyway). Set GRAPHLM_DEBUG=1 for a traceback.

`train`, `generate` and `attention` are defined by tools/train_cli.py, tools/generate_cli.py and
tools/attention_cli.py, which expose ``add_arguments(parser)`` and ``run(args) -> int``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from .argtypes import float_at_least, int_at_least, nonempty

EXIT_USAGE, EXIT_FAILED, EXIT_NO_GRAPHVIZ = 2, 1, 3
DEFAULT_PRESET = "tinylm"


class CLIError(Exception):
    """A problem with the command's input; printed as one line, exit status `code`."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


# -- models and graphs ----------------------------------------------------------------------------
def _models():
    try:
        return importlib.import_module("graphlm.models")
    except ImportError as e:
        raise CLIError(f"graphlm.models is not available ({e})", EXIT_FAILED) from None


def load_config(preset: str | None = None, config: str | None = None):
    """A GPTConfig from a preset name or JSON (a path or the text of an object)."""
    models = _models()
    GPTConfig = models.GPTConfig
    if config is not None:
        text = config
        source = "--config"
        if not config.lstrip().startswith(("{", "[")):
            path = Path(config)
            if not path.is_file():
                raise CLIError(f"--config: no such file '{config}' (give a JSON file or a JSON "
                               "object such as '{\"preset\": \"tinylm\", \"layer_count\": 2}')")
            try:
                text = path.read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise CLIError(f"--config: cannot read '{config}': {e}") from None
            source = f"--config {config}"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise CLIError(f"{source}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        if not isinstance(obj, dict):
            raise CLIError(f"{source}: expected a JSON object of GPTConfig fields, got "
                           f"{type(obj).__name__}")
        base_name = obj.pop("preset", preset)
        fields = {f.name for f in dataclasses.fields(GPTConfig)} if dataclasses.is_dataclass(GPTConfig) else None
        if fields is not None:
            unknown = sorted(set(obj) - fields)
            if unknown:
                raise CLIError(f"{source}: unknown GPTConfig field(s) {', '.join(unknown)} "
                               f"(known: {', '.join(sorted(fields))})")
        try:
            if base_name is not None:
                base = _preset(GPTConfig, base_name)
                return dataclasses.replace(base, **obj) if obj else base
            return GPTConfig(**obj)
        except TypeError as e:
            raise CLIError(f"{source}: {e}") from None
        except ValueError as e:
            raise CLIError(f"{source}: {e}") from None
    return _preset(GPTConfig, preset or DEFAULT_PRESET)


def _preset(GPTConfig, name: str):
    try:
        return GPTConfig.preset(name)
    except (KeyError, ValueError) as e:
        known = getattr(GPTConfig, "PRESETS", None)
        hint = f"; known presets: {', '.join(sorted(known))}" if isinstance(known, dict) else ""
        msg = str(e).strip("'\"")
        raise CLIError(f"unknown preset '{name}'{hint}" if hint else f"unknown preset '{name}': {msg}") from None


def build_model_graph(config, graph: str = "forward", batch_size: int = 1,
                      seq_len: int | None = None):
    """The model's graph: ``forward`` (eval mode: tokens -> logits) or ``train`` (train mode:
    logits, cross-entropy loss, gradients, and AdamW's update nodes when graphlm.optim exists).

    Returns (graph, outputs, model). Nodes only: no parameter arrays are made.
    """
    import graphlm as gl

    models = _models()
    T = config.context_length if seq_len is None else int(seq_len)
    if batch_size < 1:
        raise CLIError(f"--batch-size must be at least 1, got {batch_size}")
    if not 1 <= T <= config.context_length:
        raise CLIError(f"--seq-len must be in [1, {config.context_length}] (the context length), got {T}")
    model = models.GPT(config)
    g = gl.Graph(f"gpt_{graph}")
    tokens = g.input("tokens", (batch_size, T), "int64")
    if graph == "forward":
        model.eval()
        logits = model(tokens)
        return g, [logits], model
    if graph != "train":
        raise CLIError(f"--graph must be 'forward' or 'train', got '{graph}'")
    model.train()
    targets = g.input("targets", (batch_size, T), "int64")
    loss = model.loss(tokens, targets)
    try:
        optim = importlib.import_module("graphlm.optim")
    except ImportError:
        optim = None
    if optim is not None and hasattr(optim, "AdamW"):
        step = optim.AdamW(clip_norm=1.0).minimize(loss)
        return g, [loss, step.grad_norm, step.update], model
    grads = gl.grad(loss, list(g.params.values()))
    return g, [loss, *grads], model


def _check_out(path: str | None) -> Path | None:
    if path is None:
        return None
    from .render import RenderError, check_writable

    try:
        check_writable(Path(path))
    except RenderError as e:
        raise CLIError(str(e)) from None
    return Path(path)


# -- subcommands ------------------------------------------------------------------------------------
def _model_options(p: argparse.ArgumentParser, graph_default: str | None = "forward",
                   batch_default: int = 1) -> None:
    src = p.add_argument_group("model")
    src.add_argument("--preset", type=nonempty, default=None,
                     help=f"a GPTConfig preset: tinylm, gpt2-small or book-gpt (default: {DEFAULT_PRESET})")
    src.add_argument("--config", metavar="JSON", default=None,
                     help="a JSON file or object of GPTConfig fields; may name a \"preset\" to "
                          "start from (default: none)")
    if graph_default is not None:
        src.add_argument("--graph", choices=("forward", "train"), default=graph_default,
                         help="forward: tokens -> logits in eval mode; train: + loss, backward "
                              "and AdamW update nodes (default: %(default)s)")
    src.add_argument("--batch-size", type=int_at_least(1), default=batch_default,
                     help="batch size B of the tokens input [B,T] (default: %(default)s)")
    src.add_argument("--seq-len", type=int_at_least(1), default=None,
                     help="sequence length T (default: the config's context length)")


def _config_of(args):
    if args.preset is not None and args.config is not None:
        raise CLIError("give --preset or --config, not both (a --config object may name a "
                       "\"preset\" to start from)")
    return load_config(args.preset, args.config)


def cmd_render(args) -> int:
    from .render import GraphvizNotFound, RenderError, output_format, render_drawing

    out = Path(args.out)
    html = (args.format or out.suffix.lower().lstrip(".")) == "html"
    try:
        fmt = "html" if html else output_format(out, args.format)
    except RenderError as e:
        raise CLIError(str(e)) from None
    _check_out(args.out)
    config = _config_of(args)
    graph, outputs, _ = build_model_graph(config, args.graph, args.batch_size, args.seq_len)
    plan = None
    if args.plan:   # the graph the executor planned: after its passes
        program = _compile_numpy(graph, outputs)
        graph, plan = program.graph, program.plan
    elif args.passes:
        from graphlm.passes import run_pipeline
        graph = run_pipeline(args.passes, graph, outputs).graph
    start = time.perf_counter()
    if html:
        from .html_page import write_page

        try:
            write_page(graph, out, plan=plan)
        except RenderError as e:
            raise CLIError(str(e), EXIT_FAILED) from None
        print(f"wrote {out} (the interactive page, {out.stat().st_size:,} bytes): "
              f"{len(graph.nodes):,} nodes of the {args.graph} graph"
              + (", with the memory plan" if plan is not None else "")
              + f", in {time.perf_counter() - start:.1f} s; open it in a browser")
        return 0
    # the training graph reads at depth 1 (each sub-module one box) unless told otherwise
    depth = args.depth
    if depth is None and args.graph == "train" and not args.scope:
        depth = 1
    try:
        drawing = render_drawing(graph, out, format=fmt, depth=depth, scope=args.scope, plan=plan,
                                 timeout=args.timeout, fold=not args.unfold)
    except GraphvizNotFound as e:
        raise CLIError(str(e), EXIT_NO_GRAPHVIZ) from None
    except RenderError as e:
        raise CLIError(str(e), EXIT_FAILED) from None
    took = time.perf_counter() - start
    print(f"wrote {out} ({fmt}, {out.stat().st_size:,} bytes): {drawing.summary()} of the "
          f"{args.graph} graph" + (f", scope {args.scope}" if args.scope else "")
          + (f", depth {depth}" if depth is not None else "") + f", in {took:.1f} s")
    if drawing.warning:
        print(f"graphlm render: warning: {drawing.warning}", file=sys.stderr)
    return 0


def cmd_params(args) -> int:
    from .params import flops_per_token, format_flops, parameter_table

    config = _config_of(args)
    model = _models().GPT(config)
    table = parameter_table(model)
    count = model.parameter_count() if hasattr(model, "parameter_count") else table.total
    if count != table.total:
        raise CLIError(f"internal: the table counts {table.total:,} parameters but the model "
                       f"reports {count:,}", EXIT_FAILED)
    flops = flops_per_token(config, args.seq_len)
    if args.json:
        print(json.dumps({"config": _config_dict(config), **table.to_dict(args.depth),
                          "flops_per_token": flops}, indent=2))
        return 0
    print(f"{_config_line(config)}\n")
    print(table.format(depth=args.depth, fold=not args.unfold))
    print(format_flops(flops))
    return 0


def _config_dict(config) -> dict:
    if hasattr(config, "to_dict"):
        return config.to_dict()  # GPTConfig: mlp_hidden as the actual width
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(vars(config))


def _config_line(config) -> str:
    return (f"GPT: V={config.vocab_size} T={config.context_length} C={config.channels} "
            f"H={config.head_count} N={config.layer_count}"
            + (f" MLP={config.mlp_width}" if hasattr(config, "mlp_width") else "")
            + (", tied head" if getattr(config, "tie_weights", False) else ""))


def _compile_numpy(graph, outputs):
    from graphlm import executors

    if "numpy" not in executors.available_executors():
        raise CLIError("the numpy executor is not available, so there is no memory plan "
                       "(executors/numpy/)", EXIT_FAILED)
    return executors.get("numpy").compile(graph, outputs)


def cmd_plan(args) -> int:
    from .plan_view import format_plan, plan_report, write_arena_picture

    out = _check_out(args.out)
    config = _config_of(args)
    graph, outputs, _ = build_model_graph(config, args.graph, args.batch_size, args.seq_len)
    program = _compile_numpy(graph, outputs)
    report = plan_report(program)
    if out is not None:
        from .render import GraphvizNotFound, RenderError

        try:
            write_arena_picture(program, out, format=args.format)
        except GraphvizNotFound as e:
            raise CLIError(str(e), EXIT_NO_GRAPHVIZ) from None
        except RenderError as e:
            raise CLIError(str(e), EXIT_FAILED) from None
    if args.json:
        print(json.dumps({"config": _config_dict(config), "graph": args.graph,
                          "batch_size": args.batch_size, **report}, indent=2))
    else:
        print(f"{_config_line(config)}, {args.graph} graph, batch {args.batch_size}\n")
        print(format_plan(report))
        if out is not None:
            print(f"\nwrote {out} ({out.stat().st_size:,} bytes)")
    return 0


def cmd_stats(args) -> int:
    from .stats import format_stats, graph_stats

    config = _config_of(args)
    graph, _, _ = build_model_graph(config, args.graph, args.batch_size, args.seq_len)
    stats = graph_stats(graph)
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print(format_stats(stats, top=args.top))
    return 0


def _delegated(module: str, what: str):
    """Subcommand defined by another module (add_arguments, run); None when it is absent."""
    try:
        mod = importlib.import_module(f"graphlm.tools.{module}")
    except ModuleNotFoundError as e:
        if e.name in (f"graphlm.tools.{module}",):
            return None
        raise
    if not (hasattr(mod, "add_arguments") and hasattr(mod, "run")):
        return None
    return mod


def _version() -> str:
    from graphlm import __version__
    return __version__


def build_parser() -> argparse.ArgumentParser:
    from graphlm.passes import PIPELINES

    parser = argparse.ArgumentParser(
        prog="graphlm", description="graphlm: draw, count, plan, train and sample GPT-style "
        "models built as static graphs.",
        epilog="Run 'graphlm COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"graphlm {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("render", help="draw a model's graph with Graphviz (SVG, PNG or DOT)",
                       description="Draw a model's graph: nodes by kind, modules as nested "
                       "clusters; --depth collapses deeper modules into one box each.")
    _model_options(p)
    p.add_argument("--out", default="graph.svg",
                   help="output file; .svg, .png, .pdf, .dot, or .html for the interactive page "
                        "(default: %(default)s)")
    p.add_argument("--format", choices=("svg", "png", "pdf", "dot", "html"), default=None,
                   help="output format (default: from the --out suffix)")
    p.add_argument("--depth", type=int_at_least(0), default=None,
                   help="module levels drawn as clusters; deeper modules become one box each "
                        "with node and parameter counts (default: all levels; 1 for --graph "
                        "train without --scope)")
    p.add_argument("--unfold", action="store_true",
                   help="draw every block of a run of identical ones (default: one, "
                        "labelled blocks.0-11 x12)")
    p.add_argument("--scope", default=None,
                   help="draw only this module, e.g. blocks.1 (default: the whole graph)")
    p.add_argument("--plan", action="store_true",
                   help="annotate arena offsets, in-place nodes and views from the numpy "
                        "executor's memory plan (default: off)")
    p.add_argument("--passes", default=None, choices=sorted(PIPELINES),
                   help="draw the graph after a pass pipeline (graphlm/passes), e.g. numpy, the "
                        "one the numpy executor runs; --plan implies it (default: the graph as built)")
    p.add_argument("--timeout", type=float_at_least(0.0, strict=True), default=120.0,
                   help="seconds to let Graphviz run (default: %(default)s)")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("params", help="parameter table by module, totals, FLOPs per token",
                       description="Count parameters by module (tied weights once), with the "
                       "analytic FLOPs per token of a forward pass and a training step.")
    _model_options(p, graph_default=None)
    p.add_argument("--depth", type=int_at_least(0), default=None,
                   help="show modules down to this level (default: every parameter)")
    p.add_argument("--unfold", action="store_true",
                   help="print every block of a run of identical ones (default: one, "
                        "labelled blocks.0-11 x12)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table (default: off)")
    p.set_defaults(func=cmd_params)

    p = sub.add_parser("plan", help="the numpy executor's memory plan and an arena picture",
                       description="Compile the model's graph with the numpy executor and "
                       "report its memory plan; --out draws the arena over time.")
    _model_options(p, graph_default="train", batch_default=8)
    p.add_argument("--out", default=None,
                   help="write the arena picture here: .svg or .png (default: no picture)")
    p.add_argument("--format", choices=("svg", "png"), default=None,
                   help="picture format (default: from the --out suffix)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text (default: off)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("stats", help="node counts by op and kind, depth, width",
                       description="Statistics of a model's graph, from its nodes and its "
                       "networkx export.")
    _model_options(p)
    p.add_argument("--top", type=int_at_least(1), default=None,
                   help="show only the N most frequent ops (default: all)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text (default: off)")
    p.set_defaults(func=cmd_stats)

    for name, module, help_text in (("train", "train_cli", "train a model (tiny Shakespeare by default)"),
                                    ("generate", "generate_cli", "sample text from a checkpoint"),
                                    ("attention", "attention_cli",
                                     "picture every layer's and head's attention for a prompt")):
        mod = _delegated(module, name)
        p = sub.add_parser(name, help=help_text)  # their help texts state the defaults
        if mod is None:
            p.set_defaults(func=_unavailable(name, module))
        else:
            mod.add_arguments(p)
            p.set_defaults(func=mod.run)
    return parser


def _unavailable(name: str, module: str) -> Callable:
    def run(args) -> int:
        raise CLIError(f"'graphlm {name}' is not available in this build (tools/{module}.py is "
                       "missing)", EXIT_FAILED)
    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = f"graphlm {args.command}"
    try:
        code = args.func(args)
    except CLIError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:   # the native executor's NativeUnavailable: one line, not a traceback
        from graphlm.executors.native import NativeUnavailable
        if not isinstance(e, NativeUnavailable) or os.environ.get("GRAPHLM_DEBUG"):
            raise
        first = str(e).splitlines()[0] if str(e) else "the native executor is unavailable"
        hint = "" if "numpy executor" in first else " (--executor numpy needs no C compiler)"
        print(f"{prog}: error: {first}{hint}", file=sys.stderr)
        return EXIT_FAILED
    except (ValueError, OSError, NotImplementedError) as e:
        if os.environ.get("GRAPHLM_DEBUG"):
            raise
        what = type(e).__name__
        print(f"{prog}: error: {what}: {e}", file=sys.stderr)
        return EXIT_FAILED
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
