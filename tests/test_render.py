"""tools.render: DOT text (ids, escaping, colours, clusters, depth, scope, plan) and drawing."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import numpy as np
import pytest

import graphlm as gl
from graphlm.tools import render as R
from graphlm.tools.stats import graph_homes, module_levels, node_kind

HAVE_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAVE_DOT, reason="Graphviz dot is not installed")
SVG = "{http://www.w3.org/2000/svg}"


def nested_graph():
    """Two blocks with two sub-modules each, a loss at the root, and its gradients."""
    g = gl.Graph("nested")
    x = g.input("x", (4, 3))
    h = x
    with g.scope("blocks"):
        for i in range(2):
            with g.scope(str(i)):
                with g.scope("attention"):
                    w = g.param(f"blocks.{i}.attention.weight", (3, 3))
                    h = gl.tanh(h @ w)
                with g.scope("mlp"):
                    v = g.param(f"blocks.{i}.mlp.weight", (3, 3))
                    b = g.param(f"blocks.{i}.mlp.bias", (3,))
                    h = h + gl.relu(h @ v + b)
    loss = gl.mean(h * h)
    grads = gl.grad(loss, list(g.params.values()))
    return g, loss, grads


def node_statements(dot: str) -> dict[str, str]:
    """DOT node id -> its attribute text, for statements like ``\tn12 [label=...]``."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^\s*([A-Za-z_]\w*) \[(.*)\]$", dot, re.M)
            if m.group(1) not in ("graph", "node", "edge")}


def attr(stmt: str, key: str) -> str:
    """One attribute's value (quoted or bare) from a statement's attribute text."""
    m = re.search(rf'(?:^|\s){key}=(?:"((?:[^"\\]|\\.)*)"|([^\s"<]+))', stmt)
    return None if m is None else (m.group(1) if m.group(1) is not None else m.group(2))


# -- ids and escaping ---------------------------------------------------------------------------------
def odd_names_graph():
    g = gl.Graph('odd "graph"')
    a = g.input("enc:tokens.0", (2, 3))
    with g.scope("layer:1"):
        w = g.param("layer:1.w:q", (3, 3))
        y = gl.tanh(a @ w)
    s = g.state('cache"\\x\nline', (2, 3))
    return g, gl.sum(y * s)


def test_dot_ids_are_plain_even_when_names_have_colons_and_dots():
    g, _ = odd_names_graph()
    dot = R.to_dot(g)
    stmts = node_statements(dot)
    node_ids = [k for k in stmts if k != "legend"]
    assert node_ids and all(re.fullmatch(r"n\d+", k) for k in node_ids), node_ids
    for a, b in re.findall(r"^\s*(\S+) -> (\S+?)[ ;]", dot, re.M):
        assert re.fullmatch(r"n\d+", a) and re.fullmatch(r"n\d+", b), (a, b)
    # the names are in quoted labels, escaped
    assert 'n0 input enc:tokens.0' in dot
    assert 'n1 param layer:1.w:q' in dot
    assert 'cache\\"\\\\x\\nline' in dot      # quote, backslash, newline escaped


@needs_dot
def test_graphviz_attaches_each_edge_to_the_right_named_node():
    """Graphviz's own reading of the DOT text: each edge joins the nodes whose labels name the
    graph's producer and consumer (a ':' in an id would have made it a port of another node)."""
    g, _ = odd_names_graph()
    proc = subprocess.run(["dot", "-Tjson0"], input=R.to_dot(g, legend=False).encode(),
                          capture_output=True, check=True, timeout=60)
    laid = json.loads(proc.stdout)
    names = {o["_gvid"]: o["name"] for o in laid["objects"] if "_gvid" in o and "nodes" not in o}
    assert set(names.values()) == {f"n{n.id}" for n in g.nodes if not (n.op == "const" and n.shape == ())}
    got = {(names[e["tail"]], names[e["head"]]) for e in laid["edges"]}
    want = {(f"n{s.id}", f"n{n.id}") for n in g.nodes for s in n.inputs
            if not (s.op == "const" and s.shape == ())}
    assert got == want
    labels = {o["name"]: o["label"] for o in laid["objects"] if "label" in o and o["name"].startswith("n")}
    assert labels["n0"].startswith("n0 input enc:tokens.0")
    assert labels["n1"].startswith("n1 param layer:1.w:q")
    # Graphviz keeps label escapes (\\ and \n) until drawing; the drawn SVG has the name itself
    proc = subprocess.run(["dot", "-Tsvg"], input=R.to_dot(g).encode(), capture_output=True,
                          check=True, timeout=60)
    texts = [t.text for t in ET.fromstring(proc.stdout).iter(f"{SVG}text")]
    assert 'n4 state cache"\\x' in texts and "line" in texts


# -- labels and colours --------------------------------------------------------------------------------
def graph_with_every_kind():
    from graphlm.optim import SGD

    g = gl.Graph("kinds")
    x = g.input("x", (2, 3))
    w = g.param("w", (3, 2))
    c = g.const(np.arange(2, dtype=np.float32))
    s = g.state("running", (2, 2))
    loss = gl.mean(gl.tanh(x @ w + c) * s)
    step = SGD(lr=0.1).minimize(loss)
    return g, step


def test_labels_say_op_shape_dtype_and_names_and_colours_follow_the_kind():
    g, step = graph_with_every_kind()
    dot = R.to_dot(g)
    stmts = node_statements(dot)
    kinds_seen = set()
    for n in g.nodes:
        sid = f"n{n.id}"
        if sid not in stmts:       # scalar consts are folded into their reader's label
            assert n.op == "const" and n.shape == ()
            continue
        kind = node_kind(n)
        kinds_seen.add(kind)
        label = attr(stmts[sid], "label")
        assert label.startswith(f"n{n.id} {n.op}"), (label, n)     # the id --plan refers to
        assert f"{R.fmt_shape(n.shape)} {R.short_dtype(n.dtype)}" in label
        if n.name:
            assert n.name in label
        assert attr(stmts[sid], "fillcolor") == R.STYLE[kind][0]
    assert {"input", "param", "state", "const", "forward", "backward", "update"} <= kinds_seen
    fills = {R.STYLE[k][0] for k in ("input", "param", "forward", "backward", "update")}
    assert len(fills) == 5, "leaves, params, forward, backward and update need distinct colours"
    legend = stmts["legend"]
    for kind in kinds_seen:
        assert R.STYLE[kind][0] in legend and R.STYLE[kind][2] in legend


# -- clusters and depth ----------------------------------------------------------------------------------
def clusters(dot: str) -> list[str]:
    return re.findall(r'subgraph (cluster_\d+) \{\n[^\n]*\blabel="([^"]*)"', dot)


def test_full_depth_draws_every_module_as_nested_clusters():
    g, _, _ = nested_graph()
    modules = ["blocks.0", "blocks.0.attention", "blocks.0.mlp", "blocks.1", "blocks.1.attention",
               "blocks.1.mlp"]
    dot = R.to_dot(g, phases=False)
    labels = [lab for _, lab in clusters(dot)]
    assert sorted(labels) == sorted(modules)
    # by default (the graph has backward nodes) each module's backward nodes have a cluster of
    # their own, nested the same way, with only backward nodes in it
    phased = R.to_dot(g)
    assert sorted(lab for _, lab in clusters(phased)) == sorted(modules + [f"{m} (backward)" for m in modules])
    body = phased[phased.index('label="blocks.1.mlp (backward)"'):]
    body = body[:body.index("}")]
    ids = [int(i) for i in re.findall(r"^\s*n(\d+) \[", body, re.M)]
    assert ids and all(g.nodes[i].is_backward for i in ids)
    # blocks.0.attention is opened inside blocks.0 and closed before blocks.0 closes
    start0 = dot.index('label="blocks.0"')
    inner = dot.index('label="blocks.0.attention"')
    start1 = dot.index('label="blocks.1"')
    assert start0 < inner < start1


def test_depth_collapses_deeper_modules_into_counted_boxes():
    g, _, _ = nested_graph()
    dot = R.to_dot(g, depth=1, phases=False)
    assert sorted(lab for _, lab in clusters(dot)) == ["blocks.0", "blocks.1"]
    stmts = node_statements(dot)
    boxes = {attr(s, "tooltip"): attr(s, "label") for k, s in stmts.items() if k.startswith("m")}
    assert set(boxes) == {"blocks.0.attention", "blocks.0.mlp", "blocks.1.attention", "blocks.1.mlp"}
    homes = graph_homes(g)      # a sum of cotangents lives where its forward node is read
    for path, label in boxes.items():
        members = [n for n in g.nodes if homes[n.id] == path or homes[n.id].startswith(path + ".")]
        params = sum(n.size for n in members if n.op == "param")
        assert f"{len(members)} nodes" in label, (path, label)
        assert f"{params:,} parameters" in label, (path, label)
    # no node of a collapsed module is drawn on its own
    drawn = {int(k[1:]) for k in stmts if re.fullmatch(r"n\d+", k)}
    assert all(len(module_levels(homes[i])) <= 1 for i in drawn)
    dot0 = R.to_dot(g, depth=0, phases=False)
    assert clusters(dot0) == []
    assert {attr(s, "tooltip") for k, s in node_statements(dot0).items() if k.startswith("m")} == \
        {"blocks.0", "blocks.1"}


def test_phases_split_collapsed_modules_and_lay_the_backward_pass_out_upwards():
    """With backward nodes, a collapsed module is a forward box (its params counted there) and a
    backward box; cotangent edges between backward items are emitted reversed with dir=back,
    so `dot` ranks each backward item below its forward partner and the pass climbs back up."""
    g, _, _ = nested_graph()
    homes = graph_homes(g)
    dot = R.to_dot(g, depth=1)
    stmts = node_statements(dot)
    boxes = {attr(s, "tooltip"): attr(s, "label") for k, s in stmts.items() if k.startswith("m")}
    assert set(boxes) == {f"blocks.{i}.{m}{p}" for i in (0, 1) for m in ("attention", "mlp")
                          for p in ("", " (backward)")}
    for path in ("blocks.0.mlp", "blocks.1.attention"):
        members = [n for n in g.nodes if homes[n.id] == path]
        back = sum(n.is_backward for n in members)
        assert f"{len(members) - back} nodes" in boxes[path] and "parameters" in boxes[path]
        assert f"{back} nodes: {back} backward" in boxes[path + " (backward)"]
    box_id = {attr(s, "tooltip"): k for k, s in stmts.items() if k.startswith("m")}
    # blocks.1.mlp's backward feeds blocks.1.attention's backward: drawn from the latter, back
    a, b = box_id["blocks.1.attention (backward)"], box_id["blocks.1.mlp (backward)"]
    assert re.search(rf"^\s*{a} -> {b} \[[^\]]*dir=back", dot, re.M)
    assert not re.search(rf"^\s*{b} -> {a}\b", dot, re.M)
    # forward -> backward (saved activations) and forward -> forward keep their direction
    f = box_id["blocks.1.attention"]
    assert re.search(rf"^\s*{f} -> {a}\b", dot, re.M)
    assert "dir=back" not in re.search(rf"^\s*{box_id['blocks.0.mlp']} -> {f}\b.*$", dot, re.M).group(0)
    # the picture has the backward boxes below their forward ones, the pass climbing back
    if HAVE_DOT:
        layout = json.loads(R.dot_to(dot, "json"))
        y = {o["name"]: float(o["pos"].split(",")[1]) for o in layout["objects"] if "pos" in o}
        assert y[box_id["blocks.1.attention (backward)"]] > y[box_id["blocks.1.mlp (backward)"]]
        assert y[box_id["blocks.0.attention (backward)"]] > y[box_id["blocks.1.attention (backward)"]]


def test_scope_draws_only_that_module_with_outside_inputs_as_stubs():
    g, _, _ = nested_graph()
    dot = R.to_dot(g, scope="blocks.1")
    stmts = node_statements(dot)
    drawn = {int(k[1:]) for k in stmts if re.fullmatch(r"n\d+", k)}
    homes = graph_homes(g)
    want = {n.id for n in g.nodes if homes[n.id] == "blocks.1" or homes[n.id].startswith("blocks.1.")
            if not (n.op == "const" and n.shape == ())}
    assert drawn == want
    assert [lab for _, lab in clusters(dot)][0] == "blocks.1"
    stubs = [s for k, s in stmts.items() if k.startswith("x")]
    assert stubs and all("from " in attr(s, "label") for s in stubs)
    with pytest.raises(R.RenderError, match=r"no module scope 'blocks\.7'.*blocks\.0"):
        R.to_dot(g, scope="blocks.7")
    with pytest.raises(R.RenderError, match="depth"):
        R.to_dot(g, depth=-1)


def test_optimizer_fan_in_is_summarised():
    """An update node reading many params and moments gets one summary node per kind, and
    moments nothing else reads are drawn only there."""
    from graphlm.optim import SGD

    g = gl.Graph("fan_in")
    h = g.input("x", (2, 4))
    for i in range(R.FANIN_GROUP_ABOVE + 2):
        with g.scope(f"layer{i}"):
            h = gl.tanh(h @ g.param(f"layer{i}.w", (4, 4)))
    step = SGD(lr=0.1, momentum=0.9).minimize(gl.mean(h))
    dot = R.to_dot(g)
    stmts = node_statements(dot)
    u = step.update.id
    assert f"n{u}" in stmts
    assert not any(f"n{p.id} -> n{u}" in dot for p in g.params.values())
    assert f"g{u}_param -> n{u}" in dot and f"g{u}_state -> n{u}" in dot
    assert f"{len(g.params)} params read and written in place" in attr(stmts[f"g{u}_param"], "label")
    assert not any(f"n{s.id}" in stmts for s in g.states.values())
    small, small_step = graph_with_every_kind()
    assert f"n{small.params['w'].id} -> n{small_step.update.id}" in R.to_dot(small)


# -- the memory plan ---------------------------------------------------------------------------------------
def test_plan_annotations_match_the_numpy_plan():
    executors = pytest.importorskip("graphlm.executors")
    if "numpy" not in executors.available_executors():
        pytest.skip("numpy executor not available")
    g, loss, grads = nested_graph()
    program = executors.get("numpy").compile(g, [loss, *grads])
    plan = program.plan
    stmts = node_statements(R.to_dot(program.graph, plan=plan))   # the graph planned: after the passes
    kinds = {e.kind for e in plan.entries.values()}
    assert "inplace" in kinds and "view" in kinds
    for nid, e in plan.entries.items():
        stmt = stmts.get(f"n{nid}")
        if stmt is None:
            continue
        label = attr(stmt, "label")
        if e.kind == "arena":
            assert f"arena @{e.offset:,}" in label
        elif e.kind == "inplace":
            assert f"in place of n{e.base} @{e.offset:,}" in label and attr(stmt, "peripheries") == "2"
        elif e.kind == "view":
            assert f"view of n{e.base}" in label and "dashed" in attr(stmt, "style")


# -- files -----------------------------------------------------------------------------------------------------
@needs_dot
def test_render_writes_svg_png_and_dot(tmp_path):
    g, _, _ = nested_graph()
    svg = R.render(g, tmp_path / "g.svg", depth=1)
    root = ET.parse(svg).getroot()
    titles = [c.find(f"{SVG}title").text for c in root.iter(f"{SVG}g") if c.get("class") == "cluster"]
    assert len(titles) == 4           # blocks.0 and blocks.1, forward and backward
    png = R.render(g, tmp_path / "g.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dot = R.render(g, tmp_path / "g.gv")
    assert dot.read_text().startswith("digraph")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.gv", "g.png", "g.svg"]


def test_missing_dot_writes_the_dot_file_and_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(R.shutil, "which", lambda name: None)
    g, _, _ = nested_graph()
    with pytest.raises(R.GraphvizNotFound) as err:
        R.render(g, tmp_path / "g.svg")
    assert "apt-get install -y graphviz" in str(err.value)
    assert str(tmp_path / "g.dot") in str(err.value)
    assert not (tmp_path / "g.svg").exists()
    assert (tmp_path / "g.dot").read_text() == R.to_dot(g)


def test_bad_output_paths_fail_before_any_work(tmp_path):
    g, _, _ = nested_graph()
    with pytest.raises(R.RenderError, match="does not exist"):
        R.render(g, tmp_path / "missing" / "g.svg")
    with pytest.raises(R.RenderError, match="output format"):
        R.render(g, tmp_path / "g.jpeg2")
    with pytest.raises(R.RenderError, match="is a directory"):
        R.render(g, tmp_path, format="svg")
    assert list(tmp_path.iterdir()) == []


@needs_dot
def test_dot_failure_is_a_clear_error_and_leaves_no_partial_file(tmp_path, monkeypatch):
    g, _, _ = nested_graph()
    real_draw = R.draw

    def broken(*a, **k):
        drawing = real_draw(*a, **k)
        drawing.source = "digraph { this is not dot ;; }"
        return drawing

    monkeypatch.setattr(R, "draw", broken)
    with pytest.raises(R.RenderError, match="Graphviz 'dot' failed"):
        R.render(g, tmp_path / "g.svg")
    assert not (tmp_path / "g.svg").exists()


def tinylm_forward():
    from graphlm.models import GPT, GPTConfig

    model = GPT(GPTConfig.preset("tinylm")).eval()
    g = gl.Graph("tinylm")
    model(g.input("tokens", (1, 128), "int64"))
    return g


@needs_dot
def test_tinylm_forward_at_depth_1_has_one_cluster_per_top_level_module(tmp_path):
    g = tinylm_forward()
    svg = R.render(g, tmp_path / "tinylm.svg", depth=1, fold=False)
    root = ET.parse(svg).getroot()
    names = sorted(next(c.iter(f"{SVG}text")).text for c in root.iter(f"{SVG}g")
                   if c.get("class") == "cluster")
    top = sorted({module_levels(n.scope)[0] for n in g.nodes if n.scope})
    assert names == top
    assert names == sorted(["token_embedding", "positional_embedding", "blocks.0", "blocks.1",
                            "blocks.2", "blocks.3", "final_norm", "language_model_head"])
    texts = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert "148,224 parameters" in texts       # each block's attention box
    # folded (the default): the four identical blocks are one cluster, the rest unchanged
    svg = R.render(g, tmp_path / "folded.svg", depth=1)
    root = ET.parse(svg).getroot()
    folded = sorted(next(c.iter(f"{SVG}text")).text for c in root.iter(f"{SVG}g")
                    if c.get("class") == "cluster")
    assert folded == sorted(["token_embedding", "positional_embedding", "final_norm",
                             "language_model_head", "blocks.0-3 x4 (one drawn; counts per block)"])


# -- folding, counts, readability ----------------------------------------------------------------------
def test_folding_draws_identical_blocks_once_and_keeps_the_edges_in_and_out():
    g = tinylm_forward()
    whole, folded = R.draw(g, fold=False), R.draw(g)
    assert [r.label for r in folded.folded] == ["blocks.0-3 x4"]
    drawn = {k for k in node_statements(folded.source) if re.fullmatch(r"n\d+", k)}
    assert drawn and all(not g.nodes[int(k[1:])].scope.startswith(("blocks.1", "blocks.2", "blocks.3"))
                         for k in drawn)
    assert any(g.nodes[int(k[1:])].scope.startswith("blocks.0") for k in drawn)
    # what came out of blocks.3 (into the final norm) now comes out of blocks.0's twin
    norm = next(n for n in g.nodes if n.scope == "final_norm" and n.op == "layer_norm")
    src = norm.inputs[0]
    assert src.scope.startswith("blocks.3")
    twin = folded.folded[0].node_map[src.id]
    assert re.search(rf"^\s*n{twin} -> n{norm.id}\b", folded.source, re.M)
    # no edge from a block to itself: block i feeding block i+1 is what the fold stands for
    assert folded.items < whole.items / 2
    for a, b in re.findall(r"^\s*n(\d+) -> n(\d+)", folded.source, re.M):
        assert int(a) < int(b) or g.nodes[int(a)].op == "param", (a, b)
    # counts: every node of the graph is counted, the boxes are what is drawn
    assert folded.nodes == whole.nodes == len(g.nodes)
    assert f"{len(g.nodes)} nodes drawn as {folded.items} boxes" in folded.source
    assert folded.items == len([k for k in node_statements(folded.source) if k != "legend"])


def small_gpt(differing_block: int | None = None):
    """A 4-block GPT; `differing_block` gets RMSNorm instead of LayerNorm."""
    from graphlm import nn
    from graphlm.models import GPT, GPTConfig

    c = GPTConfig(vocab_size=32, context_length=8, channels=16, head_count=2, layer_count=4)
    model = GPT(c)
    if differing_block is not None:
        blocks = list(model.blocks)
        blocks[differing_block] = nn.DecoderBlock(c.channels, c.head_count, c.dropout,
                                                  c.layer_norm_epsilon, "rmsnorm", c.mlp,
                                                  c.gelu_approximate, c.attention_bias, c.mlp_bias,
                                                  c.mlp_hidden)
        model.blocks = nn.ModuleList(blocks)
    return model


def train_graph(model, batch=2):
    from graphlm.train import TrainOptions, train_step_graph

    return train_step_graph(model, TrainOptions(batch_size=batch, steps=10, warmup=1))


def test_every_block_of_a_training_graph_folds_and_a_different_one_does_not():
    """The last block's output is read once (by the final norm), the others' twice (the next
    block's norm and residual): the sum of those cotangents lives in the reading block, so all
    four blocks have the same structure, in the graph as built and as the executor planned it."""
    from graphlm.tools.folding import graph_repeats

    g, outputs, _ = train_graph(small_gpt())
    assert [r.label for r in graph_repeats(g)] == ["blocks.0-3 x4"]
    executors = pytest.importorskip("graphlm.executors")
    planned = executors.get("numpy").compile(g, outputs).graph
    assert planned is not g and [r.label for r in graph_repeats(planned)] == ["blocks.0-3 x4"]
    # block 2 with another norm: 0-1 fold, 2 and 3 stand alone, in the picture too
    g2, _, _ = train_graph(small_gpt(differing_block=2))
    assert [r.label for r in graph_repeats(g2)] == ["blocks.0-1 x2"]
    labels = [lab for _, lab in clusters(R.to_dot(g2, depth=1))]
    assert "blocks.0-1 x2 (one drawn; counts per block)" in labels
    assert "blocks.2" in labels and "blocks.3" in labels
    # the sums that moved are exactly the residual fan-outs: inside the block that reads them
    homes = graph_homes(g)
    moved = [n for n in g.nodes if homes[n.id] != n.scope and n.op == "add" and n.is_backward]
    assert moved and all(homes[n.id] == next(r.scope for r in g.nodes if not r.is_backward
                                              and g.forward_partner[n] in r.inputs
                                              and r.op == "add") for n in moved)


def test_different_blocks_do_not_fold():
    g, _, _ = nested_graph()       # block 1 reads its input once, block 0 twice (residual)
    assert R.draw(g).folded == []
    from graphlm.tools.folding import graph_repeats
    g2 = gl.Graph("two")
    h = g2.input("x", (2, 3))
    for i, width in enumerate((3, 3, 4)):
        with g2.scope(f"layers.{i}"):
            h = gl.tanh(h @ g2.param(f"layers.{i}.w", (h.shape[-1], width)))
    assert [r.label for r in graph_repeats(g2)] == ["layers.0-1 x2"]


def test_big_pictures_warn_and_auto_depth_stays_readable():
    from graphlm.models import GPT, GPTConfig

    model = GPT(GPTConfig.preset("tinylm"))
    g = gl.Graph("tinylm_train")
    tokens = g.input("tokens", (1, 128), "int64")
    loss = model.loss(tokens, g.input("targets", (1, 128), "int64"))
    gl.grad(loss, list(g.params.values()))
    full = R.draw(g, fold=False)
    assert full.items > R.READABLE_ITEMS
    assert "--depth" in full.warning and "--scope" in full.warning and ".html" in full.warning
    auto = R.draw(g, depth="auto", fold=False)
    assert auto.items <= R.READABLE_ITEMS and auto.warning is None
    assert R.draw(g, depth=auto.depth + 1, fold=False).items > R.READABLE_ITEMS


def test_gradients_into_the_optimizer_are_one_bundle():
    """Every gradient goes to the optimizer's global norm and its update: drawn as one edge per
    source box into a junction that counts them, and one edge out to each optimizer node."""
    g, _, _ = train_graph(small_gpt())
    grads = [n for n in g.nodes if n.op == "global_norm"][0].inputs
    for depth in (0, 1):
        d = R.draw(g, depth=depth)
        stmts = node_statements(d.source)
        assert f"{len(grads)} gradients" in attr(stmts["j_grad"], "label")
        assert f"{sum(t.size for t in grads):,} elements" in attr(stmts["j_grad"], "label")
        ins = re.findall(r"^\s*(\w+) -> j_grad\b", d.source, re.M)
        outs = re.findall(r"^\s*j_grad -> (\w+)", d.source, re.M)
        assert len(ins) == len(set(ins)) > 1 and outs
        opt = {k for k, s in stmts.items() if k.startswith("m") and "optimizer" in attr(s, "tooltip")
               or k[1:].isdigit() and graph_homes(g)[int(k[1:])] == "optimizer"}
        assert set(outs) <= opt
        # no backward item reaches an optimizer item but through the junction
        for a, b in re.findall(r"^\s*(\w+) -> (\w+)", d.source, re.M):
            if b in opt and a != "j_grad":
                assert "backward" not in (attr(stmts.get(a, ""), "tooltip") or ""), (a, b)
        assert d.items == len([k for k in stmts if k != "legend"])
    # collapsed, the update box also reads every parameter: a second bundle
    d0 = R.draw(g, depth=0)
    assert f"{len(g.params)} parameters" in attr(node_statements(d0.source)["j_param"], "label")


@needs_dot
def test_auto_depth_lays_out_and_keeps_the_picture_readable(tmp_path):
    g, _, _ = train_graph(small_gpt())
    auto = R.render_drawing(g, tmp_path / "auto.png", depth="auto")
    assert auto.size is not None and max(auto.size) <= R.READABLE_PX and auto.warning is None
    assert auto.size == R.picture_size((tmp_path / "auto.png").read_bytes(), "png")
    assert isinstance(auto.depth, int)
    # one level deeper does not fit (that is why auto stopped where it did)
    deeper = R.render_drawing(g, tmp_path / "deeper.svg", depth=auto.depth + 1)
    assert max(deeper.size) > R.READABLE_PX
    assert f"{deeper.size[0]:,}x{deeper.size[1]:,} px" in deeper.warning
    assert f"--depth {auto.depth}" in deeper.warning and "--scope blocks.0" in deeper.warning
    # a block at full depth does not read either; its suggestion does
    block = R.render_drawing(g, tmp_path / "b.svg", scope="blocks.1")
    assert block.warning and "--scope blocks.1.attention" in block.warning
    part = R.render_drawing(g, tmp_path / "a.svg", scope="blocks.1.attention")
    assert part.warning is None and max(part.size) <= R.READABLE_PX
