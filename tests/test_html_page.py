"""tools.html_page: the interactive graph page, its data, and the page itself in headless Chromium.

The browser tests drive Debian's `chromium` through Playwright (pointed at the system browser,
no downloaded build). They skip where Chromium or Playwright is missing, and fail there when
GRAPHLM_REQUIRE_BROWSER=1 or CI=true (.ci/run installs Chromium). One browser for the module.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import graphlm as gl
from graphlm.tools import html_page as H

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOT_DIR = os.environ.get("GRAPHLM_SCREENSHOT_DIR")   # keep the screenshots to look at


def small_graph():
    g = gl.Graph("small")
    x = g.input("x", (4, 3))
    h = x
    for i in range(5):
        with g.scope(f"layers.{i}"):
            h = gl.tanh(h @ g.param(f"layers.{i}.weight", (3, 3)))
    loss = gl.mean(h * h)
    grads = gl.grad(loss, list(g.params.values()))
    return g, loss, grads


def tinylm_train():
    from graphlm.tools.cli import build_model_graph, load_config
    from graphlm import executors

    g, outputs, _ = build_model_graph(load_config("tinylm"), "train", 1, None)
    program = executors.get("numpy").compile(g, outputs)
    return program.graph, program.plan       # the plan's node ids are those of the graph it planned


# -- the data and the file (no browser) --------------------------------------------------------------
def test_page_data_has_kinds_partners_sections_and_repeats():
    g, loss, grads = small_graph()
    data = H.page_data(g)
    nodes = {n["id"]: n for n in data["nodes"]}
    assert set(nodes) == {n.id for n in g.nodes if not (n.op == "const" and n.shape == ())}
    for n in g.nodes:
        if n.id not in nodes:
            continue
        d = nodes[n.id]
        assert d["label"].startswith(f"n{n.id} {n.op}")
        assert d["inputs"] == [i.id for i in n.inputs if not (i.op == "const" and i.shape == ())]
        if n.is_backward:
            partner = g.forward_partner[n]
            assert d["partner"] == partner.id and not partner.is_backward
            assert d["section"] == "backward" and "differentiation" in d["made_by"]
        else:
            assert d["partner"] is None
    # the tanh of layers.1 has backward nodes whose partner it is
    tanh1 = next(n for n in g.nodes if n.op == "tanh" and n.scope == "layers.1")
    assert any(d["partner"] == tanh1.id for d in data["nodes"])
    # the first layer's backward differs (no gradient for the input x); the sum of the two
    # cotangents of the last layer's output (h * h reads it twice) lives at the root, where it
    # is read: the other four fold
    assert [r["label"] for r in data["repeats"]] == ["layers.1-4 x4"]


def test_made_by_names_a_graph_pass_and_fused_ops_say_so():
    g = gl.Graph("fused")
    x = g.input("x", (2, 8))
    y = gl.gelu(x)
    y.attrs["pass"] = "fuse_gelu"            # what a pass records on the node it makes
    data = {n["id"]: n for n in H.page_data(g)["nodes"]}
    assert data[y.id]["made_by"] == "pass fuse_gelu"
    from graphlm.registry import REGISTRY
    assert data[y.id]["fused"] == (REGISTRY["gelu"].decompose is not None)


def test_page_is_one_self_contained_file(tmp_path):
    g, loss, grads = small_graph()
    path = H.write_page(g, tmp_path / "g.html")
    html = path.read_text()
    assert not re.search(r"<script[^>]*\bsrc=", html) and "<link" not in html
    assert "window.GraphvizWasm" in html and '<script id="graph-data"' in html
    assert "@import" not in html and "fetch(" not in H.ASSETS.joinpath("page.js").read_text()
    assert list(tmp_path.iterdir()) == [path]
    with pytest.raises(H.RenderError, match="does not exist"):
        H.write_page(g, tmp_path / "no" / "g.html")


def test_render_command_writes_the_page(tmp_path, capsys):
    from graphlm.tools.cli import main

    out = tmp_path / "small.html"
    config = '{"preset": "tinylm", "layer_count": 2, "channels": 32, "head_count": 2, "context_length": 16}'
    assert main(["render", "--config", config, "--graph", "train", "--plan", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "interactive page" in printed and out.exists()
    assert '"plan":{' in out.read_text()


def test_plan_data_bytes_live_peak_is_the_lower_bound():
    """The page's bytes-live line counts each arena buffer once: a kept value's rectangle lies
    over bytes its node's rectangle (or the buffer it views) already holds, so counting it again
    drew the TinyLM training plan's line a third above the arena."""
    g, plan = tinylm_train()
    data = H.page_data(g, plan=plan)["plan"]
    assert any(r["kind"] == "kept" for r in data["rects"])
    assert len(data["live"]) == data["steps"]
    assert max(data["live"]) == data["lower_bound_bytes"] <= data["arena_bytes"]


# -- in the browser ---------------------------------------------------------------------------------------
def _must_have_browser() -> bool:
    return bool(os.environ.get("GRAPHLM_REQUIRE_BROWSER")) or os.environ.get("CI", "").lower() == "true"


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if chromium is None or sync_playwright is None:
        why = "Chromium is not installed" if chromium is None else "playwright is not installed"
        if _must_have_browser():
            pytest.fail(f"the browser tests must run here (CI or GRAPHLM_REQUIRE_BROWSER) but {why}")
        pytest.skip(why)
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield b
        b.close()


def open_page(browser, path: Path):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(20_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("request", lambda r: errors.append(f"network request {r.url}")
            if not r.url.startswith(("file:", "data:", "blob:")) else None)
    page.goto(path.as_uri())
    page.wait_for_function("window.graphlmPage && window.graphlmPage.ready", timeout=60_000)
    return page, errors


def settle(page):
    page.wait_for_function("!window.graphlmPage.busy")
    page.evaluate("() => window.graphlmPage.redraw && new Promise(r => setTimeout(r, 0))")


def click(page, selector: str):
    """Pan the graph so the element is in the middle (as a user would), then click it."""
    page.evaluate("sel => window.graphlmPage.centerOn(document.querySelector(sel))", selector)
    page.click(selector)


def drawn_ids(page) -> set[str]:
    return set(page.eval_on_selector_all("#graph g.node", "els => els.map(e => e.id)"))


def renders(page) -> int:
    return page.evaluate("window.graphlmPage.renders")


def wait_render(page, before: int):
    page.wait_for_function(f"window.graphlmPage.renders > {before} && !window.graphlmPage.busy",
                           timeout=60_000)


@pytest.fixture(scope="module")
def train(browser, tmp_path_factory):
    g, plan = tinylm_train()
    path = H.write_page(g, tmp_path_factory.mktemp("page") / "tinylm_train.html", plan=plan)
    page, errors = open_page(browser, path)
    yield g, plan, page, errors
    page.close()


def test_small_graph_page_folds_expands_and_has_no_plan_panel(browser, tmp_path):
    g, _, _ = small_graph()
    page, errors = open_page(browser, H.write_page(g, tmp_path / "small.html"))
    ids = drawn_ids(page)
    assert "node-0" in ids                          # the input
    clusters = page.eval_on_selector_all("#graph g.cluster", "els => els.map(e => e.id)")
    assert "cluster-layers.1" in clusters and "cluster-layers.2" not in clusters
    assert "layers.1-4 x4" in page.text_content('[id="cluster-layers.1"]')
    assert page.locator("#plan-panel").count() == 0
    w2 = g.params["layers.2.weight"].id
    assert f"node-{w2}" not in ids                  # folded into layers.1's twin
    before = renders(page)
    click(page, '[id="cluster-layers.1"] text')   # the folded cluster's label: unfold
    wait_render(page, before)
    assert f"node-{w2}" in drawn_ids(page)
    assert errors == []
    page.close()


def test_training_graph_opens_folded_with_modules_as_boxes(train):
    g, plan, page, errors = train
    ids = drawn_ids(page)
    assert page.evaluate("window.graphlmPage.items") == len(ids)
    assert "module-blocks.0.attention" in ids and "module-blocks.1.attention" not in ids
    assert "module-blocks.3.attention" not in ids   # all four blocks fold, the last one too
    label = page.text_content('[id="cluster-blocks.0"]')
    assert "blocks.0-3 x4" in label
    assert page.locator("#arena rect.block").count() > 100
    assert errors == []


def test_expand_and_collapse_a_block_in_place(train):
    g, plan, page, errors = train
    qkv0 = g.params["blocks.0.attention.qkv_weight"].id
    assert f"node-{qkv0}" not in drawn_ids(page)
    before = renders(page)
    click(page, '[id="module-blocks.0.attention"]')
    wait_render(page, before)
    ids = drawn_ids(page)
    assert f"node-{qkv0}" in ids and "module-blocks.0.attention" not in ids
    inside = [n for n in g.nodes if n.scope.startswith("blocks.0.attention") and n.op != "const"]
    assert sum(f"node-{n.id}" in ids for n in inside) > 20
    before = renders(page)
    click(page, '[id="cluster-blocks.0.attention"] text')      # its label: collapse again
    wait_render(page, before)
    assert "module-blocks.0.attention" in drawn_ids(page)
    assert f"node-{qkv0}" not in drawn_ids(page)


def test_search_reveals_and_click_shows_details(train):
    g, plan, page, errors = train
    page.fill("#search", "qkv_weight")
    results = page.eval_on_selector_all("#results li.result", "els => els.map(e => e.textContent)")
    for i in range(4):
        assert any(f"blocks.{i}.attention.qkv_weight" in r for r in results), results
    target = g.params["blocks.1.attention.qkv_weight"]
    before = renders(page)
    page.click(f'#results li.result[data-id="{target.id}"]')
    wait_render(page, before)
    assert f"node-{target.id}" in drawn_ids(page)            # unfolded and expanded
    assert page.get_attribute(f'[id="node-{target.id}"]', "class").split().count("selected") == 1
    field = lambda name: page.text_content(f'#details td[data-field="{name}"]')
    assert field("shape") == "[3,192,192]" and field("kind") == "param"
    assert field("name") == "blocks.1.attention.qkv_weight" and field("dtype") == "float32"
    assert field("scope") == "blocks.1.attention"
    # a backward node of the same module: click it in the graph
    back = next(n for n in g.nodes if n.is_backward and n.scope == "blocks.1.attention"
                and n.op == "matmul" and plan.entries.get(n.id) is not None
                and plan.entries[n.id].offset is not None)
    page.fill("#search", f"n{back.id}")            # an id finds its node; the result centres it
    before = renders(page)
    page.click(f'#results li.result[data-id="{back.id}"]')
    wait_render(page, before)
    page.fill("#search", "")
    click(page, f'[id="node-{back.id}"]')
    assert field("id") == f"n{back.id}" and field("kind") == "backward"
    partner = g.forward_partner[back]
    assert field("forward partner").startswith(f"n{partner.id} {partner.op}")
    assert "differentiation" in field("made by")
    e = plan.entries[back.id]
    assert field("arena offset") == f"{e.offset:,} bytes"
    assert field("size").startswith(f"{e.nbytes:,} bytes")
    assert field("lifetime") == f"steps {e.first} to {e.last}"


def test_toggle_backward_and_optimizer_nodes(train):
    g, plan, page, errors = train
    backward = {f"node-{n.id}" for n in g.nodes if n.is_backward}
    assert drawn_ids(page) & backward
    before = renders(page)
    page.uncheck("#show-backward")
    wait_render(page, before)
    assert not drawn_ids(page) & backward
    assert "backward" not in page.text_content("#graph")
    before = renders(page)
    page.uncheck("#show-optimizer")
    wait_render(page, before)
    update = next(n for n in g.nodes if n.op == "adamw_update")
    assert f"node-{update.id}" not in drawn_ids(page) and "module-optimizer" not in drawn_ids(page)
    for box in ("#show-backward", "#show-optimizer"):
        before = renders(page)
        page.check(box)
        wait_render(page, before)
    assert drawn_ids(page) & backward


def test_gradients_reach_the_optimizer_through_one_bundle(train):
    """Drawn at the page's first depth the optimizer's nodes read every gradient; they arrive
    through one junction box that counts them, one edge per drawn source module."""
    g, plan, page, errors = train
    assert "bundle-optimizer" in drawn_ids(page)
    grads = {i.id for n in g.nodes if n.op == "global_norm" for i in n.inputs}
    text = page.text_content('[id="bundle-optimizer"]')
    assert f"{len(grads)} gradients" in text
    # every edge into an optimizer item comes from the junction or from inside the optimizer
    titles = page.eval_on_selector_all("#graph g.edge", "els => els.map(e => e.id)")   # "a->b"
    into = [t.split("->") for t in titles if t.endswith("->bundle-optimizer")]
    out = [t.split("->") for t in titles if t.startswith("bundle-optimizer->")]
    assert len(into) > 2 and len({a for a, _ in into}) == len(into) and out
    section = page.evaluate("""() => Object.fromEntries(window.graphlmPage.data.nodes
        .map((n) => ["node-" + n.id, n.section]))""")
    for t in titles:
        a, b = t.split("->")
        if section.get(b) == "optimizer" and a != "bundle-optimizer":
            assert section.get(a) == "optimizer" or a.startswith("group-"), t
    assert errors == []


def test_plan_panel_and_graph_highlight_each_other(train):
    g, plan, page, errors = train
    ids = drawn_ids(page)
    # a block whose node is drawn as itself
    nid = page.evaluate("""() => { const p = window.graphlmPage;
        const r = p.data.plan.rects.find(r => r.node != null &&
            document.getElementById('node-' + r.node) && r.nbytes > 10000);
        return r ? r.node : null; }""")
    assert nid is not None and f"node-{nid}" in ids
    rect = page.locator(f'#arena rect.block[data-node="{nid}"]').first
    rect.hover(force=True)
    assert "hl" in page.get_attribute(f'[id="node-{nid}"]', "class").split()
    page.mouse.move(0, 0)
    page.evaluate("sel => window.graphlmPage.centerOn(document.querySelector(sel))", f'[id="node-{nid}"]')
    page.hover(f'[id="node-{nid}"]')
    lit = page.eval_on_selector_all("#arena rect.block.hl", "els => els.map(e => +e.dataset.node)")
    assert lit and set(lit) == {nid}
    assert errors == []


def test_screenshot(browser, train, tmp_path):
    """A fresh page of the training graph, searched for qkv_weight and one result clicked: the
    picture docs/img/tinylm_train_page.png (GRAPHLM_SCREENSHOT_DIR=docs/img keeps it)."""
    g, plan, _, _ = train
    path = H.write_page(g, tmp_path / "tinylm_train.html", plan=plan)
    page, errors = open_page(browser, path)
    page.fill("#search", "qkv_weight")
    target = g.params["blocks.0.attention.qkv_weight"]
    before = renders(page)
    page.click(f'#results li.result[data-id="{target.id}"]')
    wait_render(page, before)
    page.mouse.move(400, 250)      # dragged right a little: the embeddings' clusters in view too
    page.mouse.down()
    page.mouse.move(470, 250, steps=5)
    page.mouse.up()
    out = Path(SCREENSHOT_DIR) if SCREENSHOT_DIR else tmp_path
    page.screenshot(path=str(out / "tinylm_train_page.png"))
    data = (out / "tinylm_train_page.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert errors == []
    page.close()
