/* graphlm graph page: walk a graph (forward, backward, optimizer, memory plan) in the browser.
 *
 * Reads the graph from the JSON in <script id="graph-data"> (tools/html_page.py writes it) and
 * lays out what is visible with Graphviz compiled to WebAssembly (window.GraphvizWasm, vendored):
 *   - modules are clusters; a collapsed module is one box with its node and parameter counts;
 *     click a box to expand it in place, click a cluster's label to collapse it;
 *   - runs of identical blocks are folded into one (blocks.0-11 x12); click it to unfold;
 *   - search by name, op or scope; a result reveals its node (expanding and unfolding);
 *   - click a node for its op, attrs, shape, dtype, scope, kind, forward partner, the pass that
 *     made it and, with a plan, its arena offset, size and lifetime;
 *   - toggles hide backward and optimizer nodes; wheel zooms, drag pans;
 *   - with a plan, a panel draws the arena over the schedule: hovering a block highlights its
 *     node in the graph, hovering a node highlights its blocks.
 * Nothing is fetched: the page works from a file with no network.
 */
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("graph-data").textContent);
  const byId = new Map(D.nodes.map((n) => [n.id, n]));
  const moduleOf = new Map(D.modules.map((m) => [m.path, m]));
  const SVGNS = "http://www.w3.org/2000/svg";
  const BUNDLE = D.bundle_colour;    // the edges into and out of the optimizer's junction
  const state = {
    expanded: new Set(D.modules.filter((m) => m.depth === 0).map((m) => m.path)),
    unfolded: new Set(),
    show: { forward: true, backward: true, optimizer: true },
    selected: null,
    query: "",
  };
  const page = (window.graphlmPage = { ready: false, busy: false, renders: 0, state: state, data: D });
  let gv = null;
  let rep = new Map();        // node id -> id of the drawn item standing for it
  let members = new Map();    // drawn item id -> node ids it stands for
  let view = null;            // the SVG viewBox [x, y, w, h]

  // -- the page's frame -------------------------------------------------------------------------
  document.body.innerHTML = `
    <header>
      <b class="title"></b>
      <input id="search" type="search" placeholder="search name, op or scope" autocomplete="off">
      <label><input id="show-backward" type="checkbox" checked> backward</label>
      <label><input id="show-optimizer" type="checkbox" checked> optimizer</label>
      <button id="expand-all" title="expand every module and unfold every repeat">expand all</button>
      <button id="collapse-all" title="back to the top-level view">collapse all</button>
      <button id="fit" title="fit the graph to the window">fit</button>
      <span id="status"></span>
    </header>
    <main>
      <div id="graph"></div>
      <aside>
        <div id="results"></div>
        <div id="details"><p class="hint">Click a node for its details; click a grey module box
          to expand it, a cluster's label to collapse it.</p></div>
      </aside>
    </main>
    <section id="plan-panel"></section>`;
  const $ = (sel) => document.querySelector(sel);
  $(".title").textContent = `${D.title}: ${D.node_count.toLocaleString("en")} nodes`;
  const graphEl = $("#graph");

  // -- what is visible ---------------------------------------------------------------------------
  function foldedRepeats() {
    return D.repeats.filter((r) => !state.unfolded.has(r.label));
  }

  function memberAt(scope, repeats) {
    for (let k = 0; k < repeats.length; k++) {
      for (const m of repeats[k].members) {
        if (scope === m || scope.startsWith(m + ".")) return [k, m];
      }
    }
    return null;
  }

  function compute() {
    const repeats = foldedRepeats();
    const twin = new Map();
    const foldLabel = new Map();
    for (const r of repeats) {
      for (const [a, b] of Object.entries(r.node_map)) twin.set(+a, b);
      foldLabel.set(r.members[0], r.label);
    }
    const items = new Map();
    const root = { children: new Map(), items: [] };
    const clusterFor = (levels) => {
      let c = root;
      for (const p of levels) {
        if (!c.children.has(p)) c.children.set(p, { path: p, children: new Map(), items: [] });
        c = c.children.get(p);
      }
      return c;
    };
    const firstClosed = (n) => n.levels.findIndex((p) => !state.expanded.has(p));
    // an update node drawn as itself with many param/state inputs gets one summary per kind
    const groups = new Map();
    const hidden = new Set();
    for (const n of D.nodes) {
      if (n.kind !== "update" || !state.show[n.section] || firstClosed(n) >= 0) continue;
      const leaves = n.inputs.map((i) => byId.get(i)).filter((i) => i && (i.op === "param" || i.op === "state"));
      if (new Set(leaves.map((l) => l.id)).size <= D.fanin_group_above) continue;
      const g = new Map();
      for (const l of leaves) {
        g.set(l.id, `group-${n.id}-${l.op}`);
        if (l.op === "state" && l.only_update) hidden.add(l.id);
      }
      groups.set(n.id, g);
    }
    rep = new Map();
    members = new Map();
    for (const n of D.nodes) {
      if (!state.show[n.section] || twin.has(n.id) || hidden.has(n.id)) continue;
      const at = firstClosed(n);
      let id;
      if (at >= 0) {
        const path = n.levels[at];
        id = `module-${path}`;
        let box = items.get(id);
        if (!box) {
          const m = moduleOf.get(path);
          box = { type: "box", id, path, short: foldLabel.get(path) || (m ? m.short : path),
                  nodes: 0, kinds: {}, params: 0 };
          items.set(id, box);
          clusterFor(n.levels.slice(0, at)).items.push(id);
        }
        box.nodes += 1;
        box.kinds[n.kind] = (box.kinds[n.kind] || 0) + 1;
        if (n.op === "param") box.params += n.size;
      } else {
        id = `node-${n.id}`;
        items.set(id, { type: "node", id, node: n });
        const c = clusterFor(n.levels);
        c.items.push(id);
        const g = groups.get(n.id);
        if (g) {
          for (const gid of new Set(g.values())) {
            if (!items.has(gid)) {
              const kind = gid.split("-").pop();
              const ins = [...g.keys()].map((i) => byId.get(i)).filter((i) => i.op === kind);
              items.set(gid, { type: "group", id: gid, kind, ins });
              c.items.push(gid);
            }
          }
        }
      }
      rep.set(n.id, id);
    }
    for (const [a, b] of twin) if (rep.has(b)) rep.set(a, rep.get(b));
    for (const [nid, item] of rep) {
      if (!members.has(item)) members.set(item, []);
      members.get(item).push(nid);
    }
    // edges; block i feeding block i+1 of a folded run is what the fold stands for: left out
    const edges = new Map();
    const sources = new Map();      // edge -> the graph nodes behind it
    for (const n of D.nodes) {
      if (!rep.has(n.id) || hidden.has(n.id)) continue;
      const g = groups.get(n.id);
      const nAt = memberAt(n.scope, repeats);
      for (const s of n.inputs) {
        if (g && g.has(s)) { edges.set(`${g.get(s)}\t${rep.get(n.id)}`, 1); continue; }
        if (!rep.has(s)) continue;
        const sAt = memberAt(byId.get(s).scope, repeats);
        if (sAt && nAt && sAt[0] === nAt[0] && sAt[1] !== nAt[1]) continue;
        const a = rep.get(s), b = rep.get(n.id);
        if (a !== b) {
          edges.set(`${a}\t${b}`, (edges.get(`${a}\t${b}`) || 0) + 1);
          if (!sources.has(`${a}\t${b}`)) sources.set(`${a}\t${b}`, new Set());
          sources.get(`${a}\t${b}`).add(s);
        }
      }
    }
    bundleIntoOptimizer(items, root, edges, sources);
    return { items, root, edges, foldLabel };
  }

  // Gradients into the optimizer (its global norm and its update both read every one) from
  // elsewhere: one junction box that counts them, one edge per drawn source into it and one
  // out to each optimizer item, instead of a fan across the picture (as render.py draws it).
  function bundleIntoOptimizer(items, root, edges, sources) {
    const inOptimizer = (id) => (items.get(id) && items.get(id).type === "group") ||
      (members.get(id) || []).some((i) => byId.get(i).section === "optimizer");
    const into = [...edges.keys()].filter((k) => {
      const [a, b] = k.split("\t");
      return inOptimizer(b) && !inOptimizer(a);
    });
    const bySource = new Map();
    for (const k of into) {
      const a = k.split("\t")[0];
      if (!bySource.has(a)) bySource.set(a, new Set());
      for (const s of sources.get(k)) bySource.get(a).add(s);
    }
    if (bySource.size < 2) return;
    const all = new Set([...bySource.values()].flatMap((set) => [...set]));
    const id = "bundle-optimizer";
    items.set(id, { type: "junction", id, ins: [...all].map((i) => byId.get(i)) });
    root.items.push(id);
    for (const k of into) {
      edges.delete(k);
      edges.set(`${id}\t${k.split("\t")[1]}`, all.size);
    }
    for (const [a, set] of bySource) edges.set(`${a}\t${id}`, set.size);
  }

  // -- DOT text ------------------------------------------------------------------------------------
  const q = (s) => '"' + String(s).replace(/\\/g, "\\\\").replace(/"/g, '\\"').replace(/\r/g, "")
    .replace(/\n/g, "\\n") + '"';
  const attrs = (o) => "[" + Object.entries(o).map(([k, v]) => `${k}=${q(v)}`).join(", ") + "]";
  const fmtInt = (x) => x.toLocaleString("en");

  function toDot(model) {
    const S = D.style;
    const out = ["digraph G {",
      '  graph [rankdir="TB", newrank="true", fontname="Helvetica", fontsize="12", nodesep="0.25", ' +
      'ranksep="0.35", labeljust="l", outputorder="edgesfirst"];',
      '  node [fontname="Helvetica", fontsize="10", style="filled", penwidth="1"];',
      '  edge [color="#777777", arrowsize="0.6", penwidth="0.8"];'];
    const emit = (id, ind) => {
      const it = model.items.get(id);
      if (it.type === "node") {
        const n = it.node;
        const [fill, border] = S[n.kind];
        const a = { id, label: n.label, shape: n.shape_kind, fillcolor: fill, color: border,
                    style: n.op in { input: 1, param: 1, state: 1, const: 1 } ? "filled" : "rounded,filled",
                    tooltip: `n${n.id} ${n.op} ${n.name || ""} ${n.shape} ${n.dtype} in ${n.scope || "<root>"}` };
        Object.assign(a, n.style);
        out.push(`${ind}${q(id)} ${attrs(a)};`);
      } else if (it.type === "box") {
        const [fill, border] = S.module;
        const kinds = Object.entries(it.kinds).map(([k, c]) => `${c} ${k}`).join(", ");
        const lines = [it.short, `${fmtInt(it.nodes)} nodes: ${kinds}`,
                       it.params ? `${fmtInt(it.params)} parameters` : "no parameters"];
        out.push(`${ind}${q(id)} ${attrs({ id, label: lines.join("\n"), shape: "box", style: "filled,bold",
          fillcolor: fill, color: border, tooltip: `${it.path}: click to expand` })};`);
      } else if (it.type === "junction") {
        const grads = it.ins.every((i) => i.kind === "backward");
        const elems = it.ins.reduce((s, i) => s + i.size, 0);
        const lines = [`${fmtInt(it.ins.length)} ${grads ? "gradients" : "tensors"}`, `${fmtInt(elems)} elements`];
        out.push(`${ind}${q(id)} ${attrs({ id, label: lines.join("\n"), shape: "box", style: "rounded,filled",
          fillcolor: S.backward[0], color: BUNDLE, penwidth: "2",
          tooltip: `the ${grads ? "gradients" : "tensors"} the optimizer reads, bundled` })};`);
      } else {
        const [fill, border] = S[it.kind];
        const elems = it.ins.reduce((s, i) => s + i.size, 0);
        const hiddenCount = it.ins.filter((i) => i.only_update && i.op === "state").length;
        const lines = [`${it.ins.length} ${it.kind}s read and written in place`, `${fmtInt(elems)} elements`];
        if (hiddenCount) lines.push(`(${hiddenCount} drawn only here)`);
        out.push(`${ind}${q(id)} ${attrs({ id, label: lines.join("\n"), shape: "folder", style: "filled",
          fillcolor: fill, color: border })};`);
      }
    };
    const walk = (c, level, ind) => {
      for (const id of c.items) emit(id, ind);
      const kids = [...c.children.values()].sort((a, b) => naturalCmp(a.path, b.path));
      for (const k of kids) {
        const fold = model.foldLabel.get(k.path);
        const label = fold ? `${fold} (one drawn; click to unfold)` : k.path;
        out.push(`${ind}subgraph ${q("cluster-" + k.path)} {`);
        out.push(`${ind}  graph ${attrs({ id: "cluster-" + k.path, label, style: "rounded,filled",
          fillcolor: D.cluster_fills[Math.min(level, D.cluster_fills.length - 1)], color: "#9aa5b1",
          fontsize: "11", tooltip: fold ? `${fold}: click to unfold` : `${k.path}: click to collapse` })};`);
        walk(k, level + 1, ind + "  ");
        out.push(`${ind}}`);
      }
    };
    walk(model.root, 0, "  ");
    for (const [key, count] of model.edges) {
      const [a, b] = key.split("\t");
      const e = { id: `${a}->${b}` };
      if (count > 1) { e.penwidth = Math.min(0.8 + 0.3 * (count - 1), 3).toFixed(1); e.tooltip = `${count} edges`; }
      if (a === "bundle-optimizer" || b === "bundle-optimizer") {
        e.color = BUNDLE;
        if (count > 1) Object.assign(e, { label: String(count), fontsize: "8", fontcolor: "#2f7d32" });
      }
      out.push(`  ${q(a)} -> ${q(b)} ${attrs(e)};`);
    }
    out.push("}");
    return out.join("\n");
  }

  function naturalCmp(a, b) {
    const pa = a.split("."), pb = b.split(".");
    for (let i = 0; i < Math.min(pa.length, pb.length); i++) {
      if (pa[i] === pb[i]) continue;
      const na = /^\d+$/.test(pa[i]), nb = /^\d+$/.test(pb[i]);
      if (na && nb) return +pa[i] - +pb[i];
      return pa[i] < pb[i] ? -1 : 1;
    }
    return pa.length - pb.length;
  }

  // -- drawing -------------------------------------------------------------------------------------
  let pending = Promise.resolve();
  function redraw(anchor) {
    pending = pending.then(() => draw(anchor)).catch((e) => {
      $("#status").textContent = "layout failed: " + e;
      console.error(e);
    });
    return pending;
  }

  async function draw(anchorId) {
    page.busy = true;
    document.body.dataset.busy = "1";
    const before = anchorId ? screenPos(anchorId) : null;
    const model = compute();
    const t0 = performance.now();
    const svgText = gv.layout(toDot(model), "svg", "dot");
    graphEl.innerHTML = svgText;
    const svg = graphEl.querySelector("svg");
    svg.removeAttribute("width");
    svg.removeAttribute("height");
    svg.setAttribute("preserveAspectRatio", "xMidYMid meet");
    for (const t of svg.querySelectorAll("title")) t.remove();   // tooltips come from <a title>
    const vb = svg.getAttribute("viewBox").split(/\s+/).map(Number);
    page.full = vb;
    if (!view || !before) view = fitView(vb);
    setView(view);
    if (before) {   // keep the clicked item where it was on the screen
      const after = screenPos(anchorId);
      if (after) {
        const k = view[2] / graphEl.clientWidth;
        view = [view[0] + (after[0] - before[0]) * k, view[1] + (after[1] - before[1]) * k, view[2], view[3]];
        setView(view);
      }
    }
    page.items = model.items.size;
    $("#status").textContent = `${fmtInt(model.items.size)} boxes drawn, laid out in ` +
      `${Math.round(performance.now() - t0)} ms`;
    markSearch();
    markSelected();
    page.renders += 1;
    page.busy = false;
    document.body.dataset.busy = "";
    document.body.dataset.renders = String(page.renders);
  }

  function fitView(vb) {
    const w = graphEl.clientWidth || 800, h = graphEl.clientHeight || 600;
    const fit = Math.min(w / vb[2], h / vb[3]);
    // the whole graph when it fits at a readable size (at most 1.2x); else its top left corner
    // at 0.8 pixels per point, where the inputs are ("fit" shows it all)
    if (fit >= 0.5) {
      const s = Math.min(fit, 1.2), vw = w / s, vh = h / s;
      return [vb[0] + (vb[2] - vw) / 2, vb[1] + (vb[3] - vh) / 2, vw, vh];
    }
    return [vb[0], vb[1], w / 0.8, h / 0.8];
  }

  function setView(v) {
    const svg = graphEl.querySelector("svg");
    if (svg) svg.setAttribute("viewBox", v.join(" "));
  }

  function screenPos(id) {
    const el = document.getElementById(id);
    if (!el) return null;
    const r = el.getBoundingClientRect();
    return [r.left + r.width / 2, r.top + r.height / 2];
  }

  function centerOn(idOrElement) {
    const el = typeof idOrElement === "string" ? document.getElementById(idOrElement) : idOrElement;
    if (!el || !view) return;
    const box = el.getBBox();
    const g = el.ownerSVGElement.querySelector("g");   // the graph's transform group
    const m = g.transform.baseVal.consolidate();
    const dx = m ? m.matrix.e : 0, dy = m ? m.matrix.f : 0;
    view = [box.x + dx + box.width / 2 - view[2] / 2, box.y + dy + box.height / 2 - view[3] / 2, view[2], view[3]];
    setView(view);
  }

  // pan and zoom
  graphEl.addEventListener("wheel", (ev) => {
    if (!view) return;
    ev.preventDefault();
    const r = graphEl.getBoundingClientRect();
    const fx = (ev.clientX - r.left) / r.width, fy = (ev.clientY - r.top) / r.height;
    const k = Math.exp(ev.deltaY * 0.0015);
    const w = view[2] * k, h = view[3] * k;
    view = [view[0] + (view[2] - w) * fx, view[1] + (view[3] - h) * fy, w, h];
    setView(view);
  }, { passive: false });
  let drag = null;
  graphEl.addEventListener("pointerdown", (ev) => { drag = { x: ev.clientX, y: ev.clientY, v: view, moved: false }; });
  window.addEventListener("pointermove", (ev) => {
    if (!drag || !view) return;
    const k = view[2] / graphEl.clientWidth;
    const dx = ev.clientX - drag.x, dy = ev.clientY - drag.y;
    if (Math.abs(dx) + Math.abs(dy) > 3) drag.moved = true;
    if (drag.moved) { view = [drag.v[0] - dx * k, drag.v[1] - dy * k, view[2], view[3]]; setView(view); }
  });
  window.addEventListener("pointerup", () => { setTimeout(() => { drag = null; }, 0); });

  // clicks on the graph
  graphEl.addEventListener("click", (ev) => {
    if (drag && drag.moved) return;
    const node = ev.target.closest("g.node");
    const cluster = ev.target.closest("g.cluster");
    if (node) {
      const id = node.id;
      if (id.startsWith("module-")) { toggleModule(id.slice(7), id); return; }
      if (id.startsWith("node-")) { select(+id.slice(5)); return; }
      return;
    }
    if (cluster) {
      const path = cluster.id.slice(8);
      const fold = D.repeats.find((r) => r.members[0] === path && !state.unfolded.has(r.label));
      if (fold) { state.unfolded.add(fold.label); redraw(cluster.id); return; }
      state.expanded.delete(path);
      redraw(null).then(() => centerOn(`module-${path}`));
    }
  });

  function toggleModule(path, anchor) {
    const fold = D.repeats.find((r) => r.members[0] === path && !state.unfolded.has(r.label));
    if (state.expanded.has(path) && fold) state.unfolded.add(fold.label);
    else state.expanded.add(path);
    return redraw(anchor);
  }

  // -- selection and details ----------------------------------------------------------------------
  function select(id) {
    state.selected = id;
    markSelected();
    showDetails(byId.get(id));
  }

  function markSelected() {
    for (const el of graphEl.querySelectorAll(".selected")) el.classList.remove("selected");
    if (state.selected == null) return;
    const item = rep.get(state.selected);
    const el = item && document.getElementById(item);
    if (el) el.classList.add("selected");
  }

  const esc = (s) => String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  const fmtBytes = (n) => {
    for (const [u, s] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]) if (n >= s) return `${(n / s).toFixed(1)} ${u}`;
    return `${n} B`;
  };
  const link = (id) => {
    const n = byId.get(id);
    return n ? `<a href="#" class="node-link" data-id="${id}">n${id} ${esc(n.op)}${n.name ? " " + esc(n.name) : ""}</a>` : `n${id}`;
  };

  function showDetails(n) {
    const rows = [
      ["id", `n${n.id}`], ["op", esc(n.op) + (n.fused ? ' <span class="tag">fused op (has a decomposition)</span>' : "")],
      ["name", n.name ? esc(n.name) : "-"], ["kind", n.kind], ["shape", n.shape], ["dtype", n.dtype],
      ["bytes", fmtBytes(n.bytes)], ["scope", esc(n.scope || "<root>")], ["made by", esc(n.made_by)],
    ];
    if (n.partner != null) rows.push(["forward partner", link(n.partner)]);
    const backs = D.nodes.filter((m) => m.partner === n.id);
    if (backs.length) rows.push(["backward nodes", backs.slice(0, 12).map((m) => link(m.id)).join(", ") + (backs.length > 12 ? ` ... ${backs.length} in all` : "")]);
    for (const [k, v] of Object.entries(n.attrs)) rows.push([`attr ${esc(k)}`, esc(v)]);
    if (n.consts.length) rows.push(["scalar inputs", esc(n.consts.join(", "))]);
    rows.push(["inputs", n.inputs.map(link).join(", ") || "-"]);
    const readers = D.nodes.filter((m) => m.inputs.includes(n.id));
    rows.push(["read by", readers.slice(0, 12).map((m) => link(m.id)).join(", ") + (readers.length > 12 ? ` ... ${readers.length} in all` : "") || "-"]);
    if (n.plan) {
      const p = n.plan;
      rows.push(["memory", esc(p.kind) + (p.base != null ? ` of ${link(p.base)}` : "")]);
      if (p.offset != null) rows.push(["arena offset", `${fmtInt(p.offset)} bytes`]);
      rows.push(["size", `${fmtInt(p.nbytes)} bytes (${fmtBytes(p.nbytes)})`]);
      rows.push(["lifetime", `steps ${p.first} to ${p.last}`]);
    } else if (D.plan) {
      rows.push(["memory", n.plan === undefined && !["input", "param", "state", "const"].includes(n.op) ? "not scheduled" : "leaf (fed or persistent)"]);
    }
    if (n.doc) rows.push(["about the op", esc(n.doc)]);
    $("#details").innerHTML = `<h3>n${n.id} ${esc(n.op)}</h3><table>` +
      rows.map(([k, v]) => `<tr><th>${k}</th><td data-field="${k}">${v}</td></tr>`).join("") + "</table>";
  }

  document.addEventListener("click", (ev) => {
    const a = ev.target.closest("a.node-link, li.result");
    if (!a) return;
    ev.preventDefault();
    reveal(+a.dataset.id);
  });

  // make a node visible (its section shown, its modules expanded, its run unfolded), select it
  function reveal(id) {
    const n = byId.get(id);
    if (!state.show[n.section]) {
      state.show[n.section] = true;
      const box = $(`#show-${n.section}`);
      if (box) box.checked = true;
    }
    for (const p of n.levels) state.expanded.add(p);
    for (const r of D.repeats) if (String(id) in r.node_map) state.unfolded.add(r.label);
    state.selected = id;
    return redraw(null).then(() => { centerOn(rep.get(id)); select(id); });
  }

  // -- search -----------------------------------------------------------------------------------------
  $("#search").addEventListener("input", (ev) => {
    state.query = ev.target.value.trim().toLowerCase();
    const q = state.query;
    const hits = q ? D.nodes.filter((n) => (n.name || "").toLowerCase().includes(q) ||
      n.op.toLowerCase().includes(q) || n.scope.toLowerCase().includes(q) || `n${n.id}` === q) : [];
    $("#results").innerHTML = q ? `<p class="count">${hits.length} match${hits.length === 1 ? "" : "es"}</p><ul>` +
      hits.slice(0, 100).map((n) => `<li class="result" data-id="${n.id}">n${n.id} <b>${esc(n.op)}</b> ${esc(n.name || "")}` +
      ` <span class="where">${esc(n.scope || "<root>")} ${n.shape}</span></li>`).join("") + "</ul>" : "";
    page.hits = hits.map((n) => n.id);
    markSearch();
  });

  function markSearch() {
    for (const el of graphEl.querySelectorAll(".match")) el.classList.remove("match");
    for (const id of page.hits || []) {
      const el = rep.has(id) && document.getElementById(rep.get(id));
      if (el) el.classList.add("match");
    }
  }

  // -- toggles and buttons --------------------------------------------------------------------------
  for (const section of ["backward", "optimizer"]) {
    $(`#show-${section}`).addEventListener("change", (ev) => { state.show[section] = ev.target.checked; redraw(null); });
  }
  $("#expand-all").addEventListener("click", () => {
    for (const m of D.modules) state.expanded.add(m.path);
    for (const r of D.repeats) state.unfolded.add(r.label);
    view = null;
    redraw(null);
  });
  $("#collapse-all").addEventListener("click", () => {
    state.expanded = new Set(D.modules.filter((m) => m.depth === 0).map((m) => m.path));
    state.unfolded.clear();
    view = null;
    redraw(null);
  });
  $("#fit").addEventListener("click", () => {
    if (!page.full) return;
    const w = graphEl.clientWidth, h = graphEl.clientHeight, vb = page.full;
    const s = Math.min(w / vb[2], h / vb[3]), vw = w / s, vh = h / s;
    view = [vb[0] + (vb[2] - vw) / 2, vb[1] + (vb[3] - vh) / 2, vw, vh];
    setView(view);
  });

  // -- the memory plan -------------------------------------------------------------------------------
  function drawPlan() {
    const P = D.plan, panel = $("#plan-panel");
    if (!P) { panel.remove(); return; }
    const W = 1000, H = 180, ML = 70, MB = 18, MT = 22;
    const top = Math.max(P.arena_bytes, ...P.rects.map((r) => r.offset + r.nbytes), 1);
    const sx = W / Math.max(P.steps, 1), sy = H / top;
    const svg = document.createElementNS(SVGNS, "svg");
    svg.setAttribute("viewBox", `0 0 ${W + ML + 10} ${H + MT + MB}`);
    svg.setAttribute("id", "arena");
    const add = (tag, a, parent) => {
      const el = document.createElementNS(SVGNS, tag);
      for (const [k, v] of Object.entries(a)) el.setAttribute(k, v);
      (parent || svg).appendChild(el);
      return el;
    };
    const head = add("text", { x: ML, y: 15, class: "plan-title" });
    head.textContent = `memory plan: arena ${P.arena_text} over ${P.steps} steps ` +
      `(lower bound ${fmtBytes(P.lower_bound_bytes)}, naive ${fmtBytes(P.naive_bytes)}); hover a block`;
    add("rect", { x: ML, y: MT, width: W, height: H, fill: "#fafafa", stroke: "#999" });
    for (const f of [0, 0.5, 1]) {
      const t = add("text", { x: ML - 4, y: MT + H - f * H + 4, "text-anchor": "end", class: "tick" });
      t.textContent = fmtBytes(Math.round(f * top));
    }
    const xt = add("text", { x: ML + W, y: MT + H + 14, "text-anchor": "end", class: "tick" });
    xt.textContent = `schedule step (0-${P.steps - 1})`;
    const colour = (k) => (P.colours && P.colours[k]) || (D.style[k] ? D.style[k][1] : "#bbb");
    P.rects.forEach((r, i) => {
      const el = add("rect", {
        x: ML + r.first * sx, y: MT + H - (r.offset + r.nbytes) * sy,
        width: Math.max((r.last - r.first + 1) * sx, 1), height: Math.max(r.nbytes * sy, 0.5),
        fill: colour(r.kind), class: "block" + (r.inplace ? " inplace" : ""), "data-node": r.node == null ? "" : r.node,
        "data-index": i,
      });
      const t = add("title", {}, el);
      t.textContent = `${r.label}: ${fmtBytes(r.nbytes)} at ${fmtInt(r.offset)}, steps ${r.first}-${r.last}`;
    });
    const live = P.live.map((b, k) => `${ML + (k + 0.5) * sx},${MT + H - b * sy}`).join(" ");
    add("polyline", { points: live, fill: "none", stroke: "#333", "stroke-width": 1, class: "live" });
    panel.appendChild(svg);
    const info = document.createElement("div");
    info.id = "plan-info";
    panel.appendChild(info);
    svg.addEventListener("mouseover", (ev) => {
      const b = ev.target.closest("rect.block");
      if (!b) return;
      const nid = b.dataset.node === "" ? null : +b.dataset.node;
      info.textContent = b.querySelector("title").textContent;
      highlightItem(nid == null ? null : rep.get(nid));
      highlightBlocks(nid == null ? [] : [nid]);
    });
    svg.addEventListener("mouseout", () => { highlightItem(null); highlightBlocks([]); });
    svg.addEventListener("click", (ev) => {
      const b = ev.target.closest("rect.block");
      if (b && b.dataset.node !== "") reveal(+b.dataset.node);
    });
  }

  function highlightItem(item) {
    for (const el of graphEl.querySelectorAll(".hl")) el.classList.remove("hl");
    const el = item && document.getElementById(item);
    if (el) el.classList.add("hl");
  }

  function highlightBlocks(nodeIds) {
    const want = new Set(nodeIds.map(String));
    for (const b of document.querySelectorAll("#arena rect.block")) b.classList.toggle("hl", want.has(b.dataset.node));
  }

  graphEl.addEventListener("mouseover", (ev) => {
    const g = ev.target.closest("g.node");
    if (!g || !D.plan) return;
    highlightBlocks(members.get(g.id) || []);
  });
  graphEl.addEventListener("mouseout", (ev) => { if (ev.target.closest("g.node")) highlightBlocks([]); });

  // -- start -------------------------------------------------------------------------------------------
  async function start() {
    $("#status").textContent = "laying out ...";
    gv = await window.GraphvizWasm.Graphviz.load();
    drawPlan();
    await redraw(null);
    page.ready = true;
    document.body.dataset.ready = "1";
  }
  page.reveal = reveal;
  page.centerOn = centerOn;
  page.select = select;
  page.redraw = redraw;
  page.toggleModule = toggleModule;
  start().catch((e) => { $("#status").textContent = "failed to start: " + e; console.error(e); });
})();
