"""The `graphlm` command: each subcommand's output and files, FLOPs, and its error paths."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tracemalloc
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

import graphlm as gl
from graphlm.models import GPT, GPTConfig
from graphlm.tools import cli
from graphlm.tools.params import flops_per_token, matmul_flops, parameter_table

ROOT = Path(__file__).resolve().parents[1]
SMALL = '{"preset": "tinylm", "layer_count": 1, "context_length": 16}'
HAVE_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAVE_DOT, reason="Graphviz dot is not installed")
SVG = "{http://www.w3.org/2000/svg}"


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- params ------------------------------------------------------------------------------------------------
def test_params_tinylm_table(capsys):
    code, out, _ = run(capsys, "params", "--preset", "tinylm")
    assert code == 0
    assert "1,902,976 parameters in 54 tensors" in out
    # the four identical blocks print once, with their total, and one block's rows under it
    assert re.search(r"^blocks\.0-3 x4 \(each 444,864\) +1,779,456 +93\.51%", out, re.M)
    assert len(re.findall(r"^ +qkv_weight +\[3,192,192\] +110,592", out, re.M)) == 1
    assert not re.search(r"^blocks\.1\b", out, re.M)
    code, out, _ = run(capsys, "params", "--preset", "tinylm", "--unfold")
    assert re.search(r"^blocks\.0 +444,864 +23\.38%", out, re.M)
    assert re.search(r"^blocks\.3 +444,864 +23\.38%", out, re.M)
    assert len(re.findall(r"^ +qkv_weight +\[3,192,192\] +110,592", out, re.M)) == 4
    assert re.search(r"^ +weight +\[256,192\] +49,152 ", out, re.M)   # head weight: untied
    assert "shared by" not in out
    assert "FLOPs per token" in out


def test_params_gpt2_small_counts_the_tied_head_once_without_allocating_weights(capsys):
    tracemalloc.start()
    try:
        code, out, _ = run(capsys, "params", "--preset", "gpt2-small", "--depth", "0")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert code == 0
    assert "124,439,808" in out
    assert peak < 50 * 2**20, f"counting allocated {peak / 2**20:.0f} MiB"   # the weights are 475 MiB
    assert "* token_embedding.weight is shared by language_model_head, token_embedding" in out
    assert "token_embedding *" not in out and re.search(r"^token_embedding +38,597,376", out, re.M)
    assert "language_model_head" not in out.split("-----")[1]       # no row of its own


def test_params_json_rows_add_up(capsys):
    code, out, _ = run(capsys, "params", "--config", SMALL, "--json")
    assert code == 0
    data = json.loads(out)
    config = GPTConfig.preset("tinylm", layer_count=1, context_length=16)
    assert data["total_parameters"] == GPT(config).parameter_count()
    rows = data["rows"]
    params = [r for r in rows if r["kind"] == "param"]
    assert sum(r["parameters"] for r in params) == data["total_parameters"]
    for m in (r for r in rows if r["kind"] == "module"):
        inside = [r for r in params if r["name"].startswith(m["name"] + ".")]
        assert m["parameters"] == sum(r["parameters"] for r in inside), m["name"]
        assert m["bytes"] == 4 * m["parameters"]
    assert abs(sum(r["share"] for r in rows if r["level"] == 0) - 1.0) < 1e-12


def test_parameter_table_from_a_graph_marks_a_weight_read_by_two_modules():
    config = GPTConfig(vocab_size=11, context_length=4, channels=8, head_count=2, layer_count=2,
                       tie_weights=True, lm_head_bias=False)
    model = GPT(config).eval()
    g = gl.Graph("tied")
    model(g.input("tokens", (1, 4), "int64"))
    table = parameter_table(g)
    assert table.total == model.parameter_count()
    assert table.shared == {"token_embedding.weight": ["language_model_head", "token_embedding"]}
    assert parameter_table(model).shared == table.shared


@pytest.mark.parametrize("mlp,mlp_hidden", [("gelu", None), ("swiglu", None), ("gelu", 100),
                                            ("swiglu", 72)])
def test_analytic_flops_match_the_matmuls_of_the_graph(mlp, mlp_hidden):
    """Forward FLOPs per token = the forward matmul FLOPs counted from node shapes / tokens;
    the backward has exactly twice the forward's matmul FLOPs, so a step is 3x."""
    config = GPTConfig.preset("tinylm", layer_count=2, mlp=mlp, dropout=0.0, mlp_hidden=mlp_hidden)
    B, T = 2, 32
    graph, _, _ = cli.build_model_graph(config, "train", B, T)
    counted = matmul_flops(graph)
    analytic = flops_per_token(config, seq_len=T)
    assert counted["forward"] == analytic["forward"] * B * T
    assert counted["backward"] == analytic["backward"] * B * T
    assert analytic["train_step"] == counted["forward"] // (B * T) * 3


# -- stats -------------------------------------------------------------------------------------------------
def test_stats_counts_agree_with_the_graph(capsys):
    code, out, _ = run(capsys, "stats", "--config", SMALL, "--graph", "train", "--json")
    assert code == 0
    data = json.loads(out)
    config = GPTConfig.preset("tinylm", layer_count=1, context_length=16, dropout=0.0)  # train's
    graph, _, _ = cli.build_model_graph(config, "train", 8)                   # and its batch size
    assert data["nodes"] == len(graph.nodes) == sum(data["by_kind"].values())
    assert data["by_op"] == dict(Counter(n.op for n in graph.nodes))
    assert data["edges"] == sum(len(n.inputs) for n in graph.nodes) - sum(
        len(n.inputs) - len({i.id for i in n.inputs}) for n in graph.nodes)
    assert data["by_kind"]["update"] >= 1 and data["by_kind"]["backward"] > data["by_kind"]["forward"]
    nx_graph = graph.to_networkx()
    import networkx as nx
    assert data["depth"] == nx.dag_longest_path_length(nx_graph) + 1
    # with no preset named, a train graph is train's default model; a forward graph the tool's
    from graphlm.train import TrainOptions
    code, out, _ = run(capsys, "stats", "--graph", "train", "--json")
    train_model = GPT(TrainOptions().config())
    assert code == 0 and json.loads(out)["parameter_elements"] == train_model.parameter_count()
    code, out, _ = run(capsys, "stats", "--json")
    assert json.loads(out)["parameter_elements"] == GPT(GPTConfig.preset(cli.DEFAULT_PRESET)).parameter_count()
    code, out, _ = run(capsys, "stats", "--config", SMALL, "--top", "3")
    assert code == 0 and "nodes by op" in out and "more ops" in out


# -- plan --------------------------------------------------------------------------------------------------
def graph_of_plan(program):
    """The nodes a program planned (its graph after the executor's passes)."""
    return [program.graph.nodes[nid] for nid in program.plan.schedule]


def test_plan_report_and_pictures(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    from graphlm import executors
    from graphlm.backends import default_executor

    code, out, _ = run(capsys, "plan", "--config", SMALL, "--batch-size", "2", "--out",
                       str(tmp_path / "arena.svg"))
    assert code == 0
    # train's defaults: dropout 0.0 and train's executor
    config = GPTConfig.preset("tinylm", layer_count=1, context_length=16, dropout=0.0)
    graph, outputs, _ = cli.build_model_graph(config, "train", 2)
    assert not any(n.op == "dropout" for n in graph.nodes)
    assert f"{default_executor()} executor" in out.splitlines()[0]
    plan = executors.get(default_executor()).compile(graph, outputs).plan
    assert f"({plan.arena_bytes:,} bytes)" in out
    assert re.search(rf"in place +{plan.inplace_count} ", out)
    assert re.search(rf"views +{plan.view_count} ", out)
    kept = [n for n in graph_of_plan(executors.get(default_executor()).compile(graph, outputs)) if n.attrs.get("kept")]
    assert kept and plan.kept_bytes == sum(n.nbytes for n in kept)   # layer norm, GELU, attention
    assert re.search(rf"kept values +{plan.kept_bytes / 2**20:,.2f} MiB +\({len(kept)} tensors", out)
    root = ET.parse(tmp_path / "arena.svg").getroot()
    groups = {g.get("id"): g for g in root.iter(f"{SVG}g") if g.get("id")}
    drawn = sum(e.kind in ("arena", "inplace") for e in plan.entries.values()) + \
        sum(b.scratch for b in plan.blocks if b.nbytes)
    assert len(list(groups["buffers"])) == drawn                 # one rectangle per buffer
    in_arena = [n for n in kept if plan.entries[n.id].offset is not None]
    assert len(list(groups["kept"])) == len(in_arena) > 0       # one hatched rectangle per kept value
    assert len(list(groups["live"].iter(f"{SVG}path"))) == 1     # the bytes-live line
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "bytes live" in texts and "ran in place" in texts and "forward buffer" in texts
    assert any(t and t.startswith("kept value (") for t in texts)
    assert "optimizer update buffer" not in texts                # only kinds that occur
    assert not any(t and "1000" in t for t in texts)             # ticks in whole units
    code, out, _ = run(capsys, "plan", "--config", SMALL, "--batch-size", "2", "--json")
    data = json.loads(out)
    assert data["arena_bytes"] == plan.arena_bytes and data["naive_bytes"] == plan.naive_bytes
    assert data["naive_over_arena"] == pytest.approx(plan.naive_bytes / plan.arena_bytes)
    assert data["kept_bytes"] == plan.kept_bytes and data["kept_count"] == len(kept)
    # PNG and PDF come from the same drawing, no Graphviz needed
    for name, magic in (("arena.png", b"\x89PNG"), ("arena.pdf", b"%PDF")):
        code, _, _ = run(capsys, "plan", "--config", SMALL, "--out", str(tmp_path / name))
        assert code == 0 and (tmp_path / name).read_bytes()[:4] == magic
    # dropout and batch size from --config, as train would read them
    code, out, _ = run(capsys, "plan", "--config", '{"layer_count": 1, "context_length": 16, '
                       '"dropout": 0.1, "batch_size": 3}', "--executor", "numpy")
    assert code == 0 and "batch 3, numpy executor" in out


# -- render ------------------------------------------------------------------------------------------------
@needs_dot
def test_render_command_writes_svg_with_one_cluster_per_module_at_the_depth(capsys, tmp_path):
    out_file = tmp_path / "fwd.svg"
    code, out, _ = run(capsys, "render", "--config", SMALL, "--depth", "1", "--out", str(out_file))
    assert code == 0 and f"wrote {out_file}" in out
    root = ET.parse(out_file).getroot()
    names = sorted(next(c.iter(f"{SVG}text")).text for c in root.iter(f"{SVG}g")
                   if c.get("class") == "cluster")
    assert names == sorted(["token_embedding", "positional_embedding", "blocks.0", "final_norm",
                            "language_model_head"])
    code, out, _ = run(capsys, "render", "--config", SMALL, "--graph", "train", "--scope",
                       "blocks.0", "--out", str(tmp_path / "b0.dot"))
    text = (tmp_path / "b0.dot").read_text()
    assert code == 0 and text.startswith("digraph") and 'label="blocks.0"' in text
    assert "backward op" in text


def test_render_without_graphviz_writes_dot_and_exits_3(capsys, tmp_path, monkeypatch):
    from graphlm.tools import render

    monkeypatch.setattr(render.shutil, "which", lambda name: None)
    code, out, err = run(capsys, "render", "--config", SMALL, "--out", str(tmp_path / "g.svg"))
    assert code == cli.EXIT_NO_GRAPHVIZ
    line = one_line_error(err)
    assert "apt-get install -y graphviz" in line and str(tmp_path / "g.dot") in line
    assert (tmp_path / "g.dot").stat().st_size > 0 and not (tmp_path / "g.svg").exists()


def test_missing_dot_through_the_console_entry_with_an_empty_path(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))     # nothing on PATH: no dot
    proc = subprocess.run([sys.executable, "-m", "graphlm", "render", "--config", SMALL,
                           "--out", str(tmp_path / "g.png")], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == cli.EXIT_NO_GRAPHVIZ
    assert "install Graphviz" in one_line_error(proc.stderr)
    assert (tmp_path / "g.dot").exists() and not (tmp_path / "g.png").exists()


# -- errors and help ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["params", "--preset", "nope"], "unknown preset 'nope'"),
    (["params", "--config", "{\"preset\": \"tinylm\", \"layers\": 2"], "invalid JSON at line 1"),
    (["params", "--config", "{\"preset\": \"tinylm\", \"layers\": 2}"], "unknown GPTConfig field(s) layers"),
    (["params", "--config", "{\"preset\": \"tinylm\", \"channels\": 100}"], "divisible"),
    (["params", "--config", "/no/such/config.json"], "no such file '/no/such/config.json'"),
    (["params", "--config", "[1, 2]"], "expected a JSON object"),
    (["params", "--preset", "tinylm", "--config", '{"preset": "gpt2-small"}'], "names preset 'gpt2-small' but --preset is 'tinylm'"),
    (["params", "--config", '{"model": 3}'], "\"model\" must be an object"),
    (["render", "--config", SMALL, "--out", "/tmp/x.dot", "--depth", "-1"], "argument --depth: must be an integer >= 0, got -1"),
    (["train", "--config", '{"steps": 0}', "--out", "/tmp/graphlm-never-written"], "TrainOptions.steps must be an integer >= 1, got 0"),
    (["train", "--config", '{"stepz": 5}', "--out", "/tmp/graphlm-never-written"], "unknown GPTConfig field(s) stepz"),
    (["generate", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["generate", "--temperature", "-1"], "temperature"),
    (["generate", "--checkpoint", "/no/such.safetensors"], "--checkpoint: no such file or run folder '/no/such.safetensors'"),
    (["export", "/no/such.safetensors", "--to", "gguf", "/tmp/x.gguf"], "CHECKPOINT: no such file"),
    (["export", "/no/such.safetensors", "--to", "onnx", "/tmp/x"], "--to: unknown format 'onnx'"),
    (["params", "--bogus"], "unrecognized arguments: --bogus (see 'graphlm params --help')"),
    (["plan", "--batch-size", "x"], "argument --batch-size: must be an integer, got 'x'"),
    (["render", "--config", SMALL, "--out", "/no/such/dir/g.svg"], "directory '/no/such/dir' does not exist"),
    (["render", "--config", SMALL, "--out", "g.bmpx"], "output format"),
    (["render", "--config", SMALL, "--out", "/tmp/x.dot", "--scope", "blocks.9"], "no module scope 'blocks.9'"),
    (["plan", "--config", SMALL, "--out", "/no/such/dir/a.svg"], "does not exist"),
    (["stats", "--config", SMALL, "--seq-len", "99"], "--seq-len must be in [1, 16]"),
    (["train", "--threads", "-1", "--out", "/tmp/graphlm-never-written"], "--threads must be >= 0, got -1"),
    (["generate", "--threads", "-2"], "--threads must be >= 0, got -2"),
])
def test_errors_are_one_clear_line_and_nonzero(capsys, argv, message):
    try:
        code, out, err = run(capsys, *argv)
    except SystemExit as stop:           # argparse's own errors exit from parse_args
        code, err = stop.code, capsys.readouterr().err
    assert code == cli.EXIT_USAGE, err   # bad input: 2
    line = one_line_error(err)
    assert line.startswith(f"graphlm {argv[0]}: error: ")
    assert message in line, line
    assert not re.search(r"\b[A-Z][a-z]+(Error|Exception)\b", line), line   # no class names


def test_bad_config_file_names_the_file(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"preset": "tinylm",\n "channels": }')
    code, _, err = run(capsys, "params", "--config", str(bad))
    assert code == 2 and f"--config {bad}: invalid JSON at line 2" in one_line_error(err)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"vocab_size": 5, "context_length": 4, "channels": 8,
                                "head_count": 2, "layer_count": 3}))
    code, out, _ = run(capsys, "params", "--config", str(good), "--json")
    assert code == 0 and len([r for r in json.loads(out)["rows"] if r["kind"] == "param"]) == 42


@pytest.mark.parametrize("command", ["render", "params", "plan", "stats", "train", "generate",
                                     "attention"])
def test_each_command_has_help_with_defaults(capsys, command):
    with pytest.raises(SystemExit) as stop:
        cli.main([command, "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: graphlm {command}")
    assert "default" in out
    if command in ("render", "params", "plan", "stats"):
        assert "--preset" in out and "--config" in out


def test_console_script_is_installed():
    exe = shutil.which("graphlm")
    if exe is None:
        pytest.skip("the graphlm console script is not on PATH (pip install -e .)")
    proc = subprocess.run([exe, "params", "--preset", "tinylm", "--depth", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "1,902,976" in proc.stdout
