"""The `graphlm` command: render, params, plan, stats, train, generate, attention, plot, export.

    graphlm render --preset tinylm --graph forward --depth 1 --out tinylm.svg
    graphlm params --preset gpt2-small
    graphlm plan --preset tinylm --batch-size 8 --out arena.png
    graphlm stats --preset tinylm --graph train
    graphlm train --config '{"layer_count": 2, "steps": 300}'
    graphlm plot runs/tinylm
    graphlm export runs/tinylm --to gguf tinylm.gguf

A model comes from ``--preset NAME`` (default tinylm) and ``--config FILE|JSON`` on top of it (a
file, or the JSON text itself: GPTConfig fields, and for train its training options; it may
name the ``"preset"``). A train graph (plan, render/stats --graph train) is the one `graphlm
train` compiles, with its dropout, batch size and executor unless told otherwise.

Exit status: 0 done; 2 bad arguments or input (one line on stderr naming the flag, file or
value); 1 the work itself failed; 3 Graphviz missing (the .dot file is written anyway); 130
interrupted (Ctrl-C); 141 stdout closed early (``graphlm params | head``), quietly. Messages
never show exception class names or tracebacks; GRAPHLM_DEBUG=1 re-raises for a traceback.

`train`, `generate`, `attention`, `plot` and `export` are defined by tools/train_cli.py,
generate_cli.py, attention_cli.py, plot.py and export_cli.py, which expose
``add_arguments(parser)`` and ``run(args) -> int``.
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
EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141      # 128 + SIGINT, 128 + SIGPIPE
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


def read_config_json(config: str) -> tuple[dict, str]:
    """The object of a ``--config`` value (a JSON file, or the JSON text itself) and how to name
    it in messages."""
    text, source = config, "--config"
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
    return obj, source


def split_config(obj: dict, source: str = "--config", preset: str | None = None) -> dict:
    """A --config object as training options: ``{"preset": ..., "model": {GPTConfig fields},
    TrainOptions fields...}``. Its keys are GPTConfig fields, TrainOptions fields, "model" (a
    dict of GPTConfig fields) and "preset"; `preset` (the --preset flag) is the base unless the
    object names the same one."""
    from graphlm.train import TrainOptions

    GPTConfig = _models().GPTConfig
    model_fields = {f.name for f in dataclasses.fields(GPTConfig)}
    train_fields = {f.name for f in dataclasses.fields(TrainOptions)} - {"model", "preset"}
    obj = dict(obj)
    named = obj.pop("preset", None)
    if named is not None and preset is not None and named != preset:
        raise CLIError(f"{source} names preset '{named}' but --preset is '{preset}'; give one")
    model = obj.pop("model", {})
    if not isinstance(model, dict):
        raise CLIError(f"{source}: \"model\" must be an object of GPTConfig fields")
    unknown = sorted((set(obj) - model_fields - train_fields) | (set(model) - model_fields))
    if unknown:
        raise CLIError(f"{source}: unknown GPTConfig field(s) {', '.join(unknown)} (known: "
                       f"{', '.join(sorted(model_fields))}; training options: "
                       f"{', '.join(sorted(train_fields))})")
    out = {k: v for k, v in obj.items() if k in train_fields}
    out["preset"] = named or preset or DEFAULT_PRESET
    out["model"] = {**model, **{k: v for k, v in obj.items() if k in model_fields}}
    return out


def load_run(preset: str | None = None, config: str | None = None,
             train_defaults: bool = False) -> tuple[object, dict]:
    """(GPTConfig, training options) from --preset and --config. With `train_defaults`, the
    model is `graphlm train`'s: its preset where none is named, and its overrides of the preset
    (dropout 0.0), as train runs it."""
    from graphlm.train import TrainOptions

    GPTConfig = _models().GPTConfig
    obj, source = read_config_json(config) if config is not None else ({}, "--preset")
    if train_defaults and preset is None and "preset" not in obj:
        preset = TrainOptions().preset
    options = split_config(obj, source, preset)
    base = dict(TrainOptions().model) if train_defaults else {}
    _preset(GPTConfig, options["preset"])           # an unknown preset: a clear message first
    try:
        cfg = GPTConfig.preset(options["preset"], **{**base, **options["model"]})
    except (TypeError, ValueError) as e:
        raise CLIError(f"{source}: {e}") from None
    return cfg, options


def load_config(preset: str | None = None, config: str | None = None, train_defaults: bool = False):
    """A GPTConfig from a preset name and/or JSON (a path or the text of an object of GPTConfig
    fields, which may name a "preset" to start from; the default preset is tinylm)."""
    return load_run(preset, config, train_defaults)[0]


def _preset(GPTConfig, name: str):
    try:
        return GPTConfig.preset(name)
    except (KeyError, ValueError) as e:
        known = getattr(GPTConfig, "PRESETS", None)
        hint = f"; known presets: {', '.join(sorted(known))}" if isinstance(known, dict) else ""
        msg = str(e).strip("'\"")
        raise CLIError(f"unknown preset '{name}'{hint}" if hint else f"unknown preset '{name}': {msg}") from None


def build_model_graph(config, graph: str = "forward", batch_size: int = 1,
                      seq_len: int | None = None, options: dict | None = None):
    """The model's graph: ``forward`` (eval mode: tokens -> logits) or ``train`` (the training
    step `graphlm train` compiles: train mode, loss, backward, clipping and AdamW's update, with
    the training options `options`, default train's).

    Returns (graph, outputs, model). Nodes only: no parameter arrays are made.
    """
    import graphlm as gl
    from graphlm.train import TrainOptions, train_step_graph

    models = _models()
    T = config.context_length if seq_len is None else int(seq_len)
    if batch_size < 1:
        raise CLIError(f"--batch-size must be at least 1, got {batch_size}")
    if not 1 <= T <= config.context_length:
        raise CLIError(f"--seq-len must be in [1, {config.context_length}] (the context length), got {T}")
    model = models.GPT(config)
    if graph == "forward":
        g = gl.Graph(f"gpt_{graph}")
        tokens = g.input("tokens", (batch_size, T), "int64")
        model.eval()
        logits = model(tokens)
        return g, [logits], model
    if graph != "train":
        raise CLIError(f"--graph must be 'forward' or 'train', got '{graph}'")
    fields = {f.name for f in dataclasses.fields(TrainOptions)} - {"model", "preset"}
    known = {k: v for k, v in (options or {}).items() if k in fields}
    try:
        train_options = TrainOptions(**{**known, "batch_size": batch_size})
    except (TypeError, ValueError) as e:
        raise CLIError(f"--config: {e}") from None
    g, outputs, _ = train_step_graph(model, train_options, seq_len=T)
    return g, outputs, model


def check_out(path: str | None) -> Path | None:
    if path is None:
        return None
    from .render import RenderError, check_writable

    try:
        check_writable(Path(path))
    except RenderError as e:
        raise CLIError(str(e)) from None
    return Path(path)


_check_out = check_out      # the old name (tools/attention_cli.py imports it)


DEFAULT_RUN = "runs/tinylm"   # `graphlm train`'s default --out


def resolve_checkpoint(path: str | None, what: str) -> Path:
    """The checkpoint file a command reads: `path` itself when it is a file; for a run folder
    (and for no path: the default run folder) its best.safetensors (the lowest validation loss)
    where there is one, else its checkpoint.safetensors (the last state). Anything else is a
    one-line CLIError naming `what` and the path."""
    from graphlm.train import BEST_NAME, CHECKPOINT_NAME
    p = Path(path if path is not None else DEFAULT_RUN)
    if p.is_file():
        return p
    if p.is_dir():
        for name in (BEST_NAME, CHECKPOINT_NAME):
            if (p / name).is_file():
                return p / name
        raise CLIError(f"{what}: the folder '{p}' holds neither {BEST_NAME} nor {CHECKPOINT_NAME}")
    hint = ""
    if path is None:
        hint = (f" (the default run folder, relative to the current folder {Path.cwd()}: run "
                f"'graphlm train' here first, or give a run folder or checkpoint file, e.g. {what} "
                "/path/to/run)")
    raise CLIError(f"{what}: no such file or run folder '{p}'{hint}")


# -- subcommands ------------------------------------------------------------------------------------
def _model_options(p: argparse.ArgumentParser, graph_default: str | None = "forward",
                   batch_default: int | None = None) -> None:
    """--preset, --config, --graph, --batch-size, --seq-len. The batch size defaults to 1 for a
    forward graph and to train's batch size for a train graph."""
    if batch_default is None:
        batch_default = _train_defaults().batch_size if graph_default == "train" else 1
    src = p.add_argument_group("model")
    src.add_argument("--preset", type=nonempty, default=None,
                     help=f"a GPTConfig preset: tinylm, tinylm-small, tinylm-gpt2 (no LM-head bias), "
                          f"gpt2-small or book-gpt (default: {DEFAULT_PRESET}; with --graph train, "
                          f"train's: {_train_defaults().preset})")
    src.add_argument("--config", metavar="FILE|JSON", default=None,
                     help="a JSON file or object of GPTConfig fields (and training options, "
                          "which --graph train uses) on top of the preset, e.g. "
                          "'{\"layer_count\": 2}'; may name the \"preset\" (default: none)")
    if graph_default is not None:
        src.add_argument("--graph", choices=("forward", "train"), default=graph_default,
                         help="forward: tokens -> logits in eval mode; train: + loss, backward "
                              "and AdamW update nodes (default: %(default)s)")
    src.add_argument("--batch-size", type=int_at_least(1), default=None,
                     help=f"batch size B of the tokens input [B,T] (default: the --config's "
                          f"batch_size, else {batch_default}" + ("" if graph_default == "train" else
                          f"; {_train_defaults().batch_size}, train's, for --graph train") + ")")
    src.add_argument("--seq-len", type=int_at_least(1), default=None,
                     help="sequence length T (default: the config's context length)")


def _train_defaults():
    from graphlm.train import TrainOptions
    return TrainOptions()


def _config_of(args):
    """The command's GPTConfig; for a train graph with train's model defaults (dropout), and
    args.options / args.batch_size filled in from --config."""
    train = getattr(args, "graph", None) == "train"
    config, options = load_run(args.preset, args.config, train_defaults=train)
    args.options = options
    if getattr(args, "batch_size", 0) is None:
        args.batch_size = options.get("batch_size") or (
            _train_defaults().batch_size if train else 1)
    return config


def _graph_of(args):
    config = _config_of(args)
    graph, outputs, model = build_model_graph(config, args.graph, args.batch_size, args.seq_len,
                                              args.options)
    return config, graph, outputs


def _executor_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--executor", choices=("auto", "native", "numpy"), default=None,
                   help="whose memory plan: native or numpy (the same planner; default: the "
                        "--config's executor, else auto, as graphlm train: native where a C "
                        "compiler works, else numpy)")


def _check_scope(graph, args) -> None:
    """--scope is input: an unknown one exits 2 before any drawing."""
    from .stats import all_scopes, module_levels

    if args.scope:
        scopes = all_scopes(graph)
        if args.scope not in scopes:
            top = sorted(s for s in scopes if len(module_levels(s)) <= 1)
            raise CLIError(f"--scope: the {args.graph} graph has no module scope '{args.scope}' "
                           f"(top-level modules: {', '.join(top)})")


def cmd_render(args) -> int:
    from .render import GraphvizNotFound, RenderError, output_format, render_drawing

    out = Path(args.out)
    html = (args.format or out.suffix.lower().lstrip(".")) == "html"
    try:
        fmt = "html" if html else output_format(out, args.format)
    except RenderError as e:
        raise CLIError(str(e)) from None
    check_out(args.out)
    config, graph, outputs = _graph_of(args)
    _check_scope(graph, args)
    plan = None
    if args.plan:   # the graph the executor planned: after its passes
        program = _compile_planned(graph, outputs, args)
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
    # a training graph (forward, backward, optimizer) is drawn at the deepest depth that reads
    # at screen size unless told otherwise
    depth = args.depth
    if depth is None and args.graph == "train":
        depth = "auto"
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
          + (f", depth {drawing.depth}" if drawing.depth is not None else "")
          + (f" ({drawing.size[0]:,}x{drawing.size[1]:,} px)" if drawing.size else "")
          + f", in {took:.1f} s")
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


def _compile_planned(graph, outputs, args):
    """Compile with the executor train would use (or --executor / the --config's): its memory
    plan is what `plan` reports and `render --plan` draws."""
    from graphlm import executors
    from graphlm.backends import default_executor

    name = args.executor or args.options.get("executor") or "auto"
    if name == "auto":
        name = default_executor()
    if name not in executors.available_executors() or name == "reference":
        raise CLIError(f"--executor {name}: no memory plan (give native or numpy)", EXIT_USAGE)
    return executors.get(name).compile(graph, outputs)


def cmd_plan(args) -> int:
    from .plan_view import format_plan, plan_report, write_arena_picture

    out = check_out(args.out)
    config, graph, outputs = _graph_of(args)
    program = _compile_planned(graph, outputs, args)
    report = plan_report(program)
    if out is not None:
        from .render import RenderError

        try:
            write_arena_picture(program, out, format=args.format)
        except RenderError as e:
            raise CLIError(str(e), EXIT_FAILED) from None
    executor = getattr(program, "executor_name", "numpy")
    if args.json:
        print(json.dumps({"config": _config_dict(config), "graph": args.graph,
                          "batch_size": args.batch_size, "executor": executor, **report}, indent=2))
    else:
        print(f"{_config_line(config)}, {args.graph} graph, batch {args.batch_size}, "
              f"{executor} executor\n")
        print(format_plan(report))
        if out is not None:
            print(f"\nwrote {out} ({out.stat().st_size:,} bytes)")
    return 0


def cmd_stats(args) -> int:
    from .stats import format_stats, graph_stats

    _, graph, _ = _graph_of(args)
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


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (and a pointer to --help) instead of the usage block."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    from graphlm.passes import PIPELINES

    parser = Parser(
        prog="graphlm", description="graphlm: draw, count, plan, train and sample GPT-style "
        "models built as static graphs.",
        epilog="Run 'graphlm COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"graphlm {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    parser.commands = sub.choices          # name -> its parser

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
                        "with node and parameter counts (default: all levels; for --graph "
                        "train the deepest whose picture reads at screen size, about 2500 px)")
    p.add_argument("--unfold", action="store_true",
                   help="draw every block of a run of identical ones (default: one, "
                        "labelled blocks.0-11 x12)")
    p.add_argument("--scope", default=None,
                   help="draw only this module, e.g. blocks.1 (default: the whole graph)")
    p.add_argument("--plan", action="store_true",
                   help="annotate arena offsets, in-place nodes and views from the executor's "
                        "memory plan (default: off)")
    _executor_option(p)
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

    p = sub.add_parser("plan", help="the executor's memory plan and an arena picture",
                       description="Compile the model's graph as 'graphlm train' does (its "
                       "dropout, batch size and executor unless told otherwise) and report the "
                       "memory plan; --out draws the arena over time.")
    _model_options(p, graph_default="train")
    _executor_option(p)
    p.add_argument("--out", default=None,
                   help="write the arena picture here: .png, .svg or .pdf (default: no picture)")
    p.add_argument("--format", choices=("png", "svg", "pdf"), default=None,
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

    for name, module, help_text in (
            ("train", "train_cli", "train a model (TinyLM on tiny Shakespeare by default)"),
            ("generate", "generate_cli", "sample text from a checkpoint"),
            ("attention", "attention_cli", "picture every layer's and head's attention for a prompt"),
            ("plot", "plot", "draw a training run's loss curve from its log.jsonl"),
            ("export", "export_cli", "write a checkpoint as a Hugging Face GPT-2 folder or a GGUF file")):
        mod = _delegated(module, name)
        doc = (getattr(mod, "__doc__", None) or "").strip().split("\n")[0].split(": ", 1)[-1]
        doc = doc or help_text + "."
        p = sub.add_parser(name, help=help_text, description=doc[0].upper() + doc[1:])
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


def _quiet_broken_pipe() -> int:
    """stdout (or stderr) went away, as in ``graphlm params | head``: point both at /dev/null so
    the interpreter's final flush stays quiet, and exit as a process killed by SIGPIPE would."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            try:
                os.dup2(devnull, stream.fileno())
            except (OSError, ValueError):
                pass
    except OSError:
        pass
    return EXIT_BROKEN_PIPE


def describe_error(e: BaseException) -> str:
    """An exception as one line for a user: its message, never its class name."""
    if isinstance(e, OSError) and e.strerror:
        where = f"'{e.filename}': " if e.filename else ""
        return f"{where}{e.strerror[0].lower()}{e.strerror[1:]}"
    text = str(e).strip().strip("'\"") or "failed"
    return " ".join(text.split("\n")[0].split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns its exit status: 0, 1 (the work failed), 2 (bad input or
    arguments), 3 (Graphviz missing), 130 (interrupted), 141 (stdout closed early)."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:     # name the subcommand whose flags these are not
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    except BrokenPipeError:
        return _quiet_broken_pipe()
    prog = f"graphlm {args.command}"
    try:
        code = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except CLIError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RuntimeError as e:   # the native executor's NativeUnavailable: one line, with a hint
        from graphlm.executors.native import NativeUnavailable
        if not isinstance(e, NativeUnavailable) or os.environ.get("GRAPHLM_DEBUG"):
            return _report_failure(prog, e)
        first = str(e).splitlines()[0] if str(e) else "the native executor is unavailable"
        hint = "" if "numpy executor" in first else " (--executor numpy needs no C compiler)"
        print(f"{prog}: error: {first}{hint}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as e:
        return _report_failure(prog, e)
    return int(code or 0)


def _report_failure(prog: str, e: Exception) -> int:
    """One line for an exception the command did not turn into a CLIError: exit 2 for bad input
    (a value, a missing or unreadable path), 1 for anything else (a divergence, a disk error)."""
    from graphlm.train import Diverged

    if os.environ.get("GRAPHLM_DEBUG"):
        raise e
    bad_input = isinstance(e, (ValueError, FileNotFoundError, IsADirectoryError,
                               NotADirectoryError, PermissionError)) and not isinstance(e, Diverged)
    known = bad_input or isinstance(e, (Diverged, OSError, NotImplementedError, RuntimeError))
    hint = "" if known else " (an unexpected failure; GRAPHLM_DEBUG=1 shows the traceback)"
    try:
        print(f"{prog}: error: {describe_error(e)}{hint}", file=sys.stderr)
    except BrokenPipeError:
        return _quiet_broken_pipe()
    return EXIT_USAGE if bad_input else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
