// evergraph's live view: the running graph, one column per topological depth,
// each vertex coloured by its state and kept current from the server-sent events
// of /api/v1/graph/events. Plain JS and SVG, no build step. Every text from the
// server goes into the page as text (textContent), never as markup.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
// the fill of each state; "repaired" is shown for FLASH_MS after a vertex changed
// something while the page watched (then it shows its state again)
const COLOURS = {
  pending: "#8c959f",
  running: "#0969da",
  clean: "#2e9d5b",
  changed: "#2e9d5b",
  retrying: "#d1700e",
  failed: "#cf222e",
  unknown: "#8250df",
  repaired: "#d4a72c",
};
const FLASH_MS = 2500;
const W = 200, H = 24, GAP_X = 60, GAP_Y = 8, PAD = 20;
const SMALL = 1500; // more vertices than this: small squares without labels

const byId = (id) => document.getElementById(id);
const vertices = new Map(); // ident -> {st, el, rect, flashUntil, timer}
let edges = [];
let selected = null;
let seq = 0;
let source = null;
let reloadTimer = null;
// a vertex's parameters need an admin token: open the page as /#token=TOKEN; it is
// kept for this tab only and taken out of the address bar (the fragment never
// reaches the server)
const TOKEN = (() => {
  const m = location.hash.match(/[#&]token=([^&]+)/);
  if (m) {
    sessionStorage.setItem("evergraph-token", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem("evergraph-token");
})();

function legend() {
  const ul = byId("legend");
  ul.replaceChildren();
  const counts = {};
  for (const v of vertices.values()) counts[v.st.state] = (counts[v.st.state] || 0) + 1;
  for (const state of ["pending", "running", "clean", "changed", "retrying", "failed", "unknown"]) {
    const li = document.createElement("li");
    li.style.setProperty("--c", COLOURS[state]);
    li.dataset.state = state;
    li.textContent = `${state} ${counts[state] || 0}`;
    ul.append(li);
  }
  const li = document.createElement("li");
  li.style.setProperty("--c", COLOURS.repaired);
  li.textContent = "just changed";
  ul.append(li);
}

let legendTimer = null;
function legendSoon() {
  if (legendTimer) return;
  legendTimer = setTimeout(() => {
    legendTimer = null;
    legend();
  }, 100);
}

function depths(idents) {
  // longest path from a root: a vertex sits right of everything it depends on
  const indeg = new Map(idents.map((i) => [i, 0]));
  const out = new Map(idents.map((i) => [i, []]));
  for (const e of edges) {
    if (!indeg.has(e.from) || !indeg.has(e.to)) continue;
    indeg.set(e.to, indeg.get(e.to) + 1);
    out.get(e.from).push(e.to);
  }
  const depth = new Map(idents.map((i) => [i, 0]));
  const queue = idents.filter((i) => indeg.get(i) === 0);
  for (let k = 0; k < queue.length; k++) {
    const a = queue[k];
    for (const b of out.get(a)) {
      depth.set(b, Math.max(depth.get(b), depth.get(a) + 1));
      indeg.set(b, indeg.get(b) - 1);
      if (indeg.get(b) === 0) queue.push(b);
    }
  }
  return depth;
}

function shownState(v) {
  return v.flashUntil > Date.now() ? "repaired" : v.st.state;
}

function paint(v) {
  const shown = shownState(v);
  v.rect.setAttribute("fill", COLOURS[shown]);
  v.el.dataset.state = v.st.state;
  v.el.dataset.shown = shown;
  v.title.textContent = `${v.st.ident}: ${v.st.state}`;
}

function draw(graph) {
  const svg = byId("graph");
  svg.replaceChildren();
  byId("graph-name").textContent = graph.graph || "";
  edges = graph.edges;
  const idents = graph.vertices.map((s) => s.ident).sort();
  const depth = depths(idents);
  const small = idents.length > SMALL;
  const w = small ? 10 : W, h = small ? 10 : H, gx = small ? 20 : GAP_X, gy = small ? 2 : GAP_Y;
  // one column per depth; a tall one wraps into sub-columns (10k independent
  // files make a square, not a strip 10k high)
  const maxRows = small ? Math.max(30, Math.ceil(1.5 * Math.sqrt(idents.length))) : 40;
  const byDepth = new Map();
  for (const i of idents) {
    const d = depth.get(i);
    if (!byDepth.has(d)) byDepth.set(d, []);
    byDepth.get(d).push(i);
  }
  const pos = new Map();
  const sub = small ? 2 : 12; // the gap between sub-columns of one depth
  let x = PAD, rowsUsed = 1;
  for (const d of [...byDepth.keys()].sort((a, b) => a - b)) {
    const list = byDepth.get(d);
    list.forEach((ident, k) => {
      const col = Math.floor(k / maxRows), row = k % maxRows;
      pos.set(ident, [x + col * (w + sub), PAD + row * (h + gy)]);
    });
    rowsUsed = Math.max(rowsUsed, Math.min(maxRows, list.length));
    x += Math.ceil(list.length / maxRows) * (w + sub) - sub + gx;
  }
  svg.setAttribute("width", x - gx + PAD);
  svg.setAttribute("height", PAD * 2 + rowsUsed * (h + gy));
  const edgeLayer = document.createElementNS(SVG, "g");
  const vertexLayer = document.createElementNS(SVG, "g");
  svg.append(edgeLayer, vertexLayer);
  for (const e of edges) {
    const a = pos.get(e.from), b = pos.get(e.to);
    if (!a || !b) continue;
    const p = document.createElementNS(SVG, "path");
    const x1 = a[0] + w, y1 = a[1] + h / 2, x2 = b[0], y2 = b[1] + h / 2, mx = (x1 + x2) / 2;
    p.setAttribute("d", `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2},${y2}`);
    p.setAttribute("class", e.notify ? "edge notify" : "edge");
    edgeLayer.append(p);
  }
  const old = new Map(vertices);
  vertices.clear();
  for (const st of graph.vertices) {
    const [x, y] = pos.get(st.ident);
    const g = document.createElementNS(SVG, "g");
    g.setAttribute("class", "vertex");
    g.dataset.ident = st.ident;
    const rect = document.createElementNS(SVG, "rect");
    rect.setAttribute("x", x);
    rect.setAttribute("y", y);
    rect.setAttribute("width", w);
    rect.setAttribute("height", h);
    rect.setAttribute("rx", 3);
    const title = document.createElementNS(SVG, "title");
    g.append(rect, title);
    if (!small) {
      const text = document.createElementNS(SVG, "text");
      text.setAttribute("x", x + 6);
      text.setAttribute("y", y + h / 2 + 4);
      const label = st.ident.length > 28 ? "…" + st.ident.slice(-27) : st.ident;
      text.textContent = label;
      g.append(text);
    }
    g.addEventListener("click", () => select(st.ident));
    vertexLayer.append(g);
    const before = old.get(st.ident);
    const v = { st, el: g, rect, title, flashUntil: before ? before.flashUntil : 0, timer: null };
    vertices.set(st.ident, v);
    paint(v);
    if (selected === st.ident) g.classList.add("selected");
  }
  legend();
}

function update(st) {
  const v = vertices.get(st.ident);
  if (st.state === "removed") {
    if (v) reloadSoon(); // it left the graph: draw the graph without it
    return;
  }
  if (!v) {
    reloadSoon(); // a vertex the drawing lacks: the graph was swapped
    return;
  }
  if (st.changed_count > v.st.changed_count) {
    // it changed something while we watched (a drift repaired): flash it
    v.flashUntil = Date.now() + FLASH_MS;
    clearTimeout(v.timer);
    v.timer = setTimeout(() => paint(v), FLASH_MS + 10);
  }
  v.st = st;
  paint(v);
  if (selected === st.ident) showStatus(st);
}

function reloadSoon() {
  if (reloadTimer) return;
  reloadTimer = setTimeout(() => {
    reloadTimer = null;
    load();
  }, 300);
}

function row(dl, name, value) {
  const dt = document.createElement("dt");
  dt.textContent = name;
  const dd = document.createElement("dd");
  dd.textContent = value;
  dd.dataset.field = name;
  dl.append(dt, dd);
}

function seconds(s) {
  if (s < 0.001) return `${(s * 1e6).toFixed(0)} µs`;
  if (s < 1) return `${(s * 1e3).toFixed(1)} ms`;
  return `${s.toFixed(2)} s`;
}

function showStatus(st) {
  byId("p-ident").textContent = st.ident;
  const dl = byId("p-status");
  dl.replaceChildren();
  row(dl, "state", st.state);
  row(dl, "kind", st.kind);
  row(dl, "last check took", seconds(st.duration));
  row(dl, "last change", st.last_changed ? new Date(st.last_changed * 1000).toLocaleString() : "never");
  row(dl, "runs", `${st.clean_count} clean, ${st.changed_count} changed, ${st.fail_count} failed`);
  const err = byId("p-error");
  err.textContent = st.error || "none";
  err.classList.toggle("empty", !st.error);
  const box = byId("p-changes");
  box.replaceChildren();
  box.classList.toggle("empty", !st.changes.length);
  if (!st.changes.length) box.textContent = "none";
  for (const c of st.changes) {
    const div = document.createElement("div");
    div.className = "change";
    const f = document.createElement("span");
    f.className = "field";
    f.textContent = c.field;
    div.append(f);
    if (c.diff) {
      const pre = document.createElement("pre");
      pre.className = "diff";
      for (const line of c.diff.split("\n")) {
        const span = document.createElement("span");
        if (line.startsWith("+") && !line.startsWith("+++")) span.className = "add";
        if (line.startsWith("-") && !line.startsWith("---")) span.className = "del";
        span.textContent = line + "\n";
        pre.append(span);
      }
      div.append(pre);
    } else {
      div.append(`: ${c.old === null ? "(none)" : c.old} → ${c.new === null ? "(none)" : c.new}`);
    }
    box.append(div);
  }
}

async function select(ident) {
  selected = ident;
  for (const v of vertices.values()) v.el.classList.toggle("selected", v.st.ident === ident);
  const panel = byId("panel");
  panel.hidden = false;
  const v = vertices.get(ident);
  if (v) showStatus(v.st);
  const params = byId("p-params");
  params.textContent = "…";
  const headers = TOKEN ? { Authorization: "Bearer " + TOKEN } : {};
  const r = await fetch("/api/v1/graph/vertices/" + encodeURIComponent(ident), { headers });
  if (selected !== ident) return;
  if (!r.ok) {
    params.textContent =
      r.status === 401 || r.status === 403
        ? `(${r.status}: parameters need an admin token; open this page as /#token=TOKEN)`
        : `(${r.status})`;
    return;
  }
  const body = await r.json();
  params.textContent = JSON.stringify(body.params, null, 2);
  showStatus(body.status);
}

function listen() {
  if (source) source.close();
  source = new EventSource(`/api/v1/graph/events?after=${seq}`);
  const conn = byId("conn");
  source.onopen = () => {
    conn.dataset.conn = "live";
    conn.textContent = "live";
  };
  source.onerror = () => {
    conn.dataset.conn = "reconnecting";
    conn.textContent = "reconnecting…";
  };
  source.onmessage = (e) => {
    update(JSON.parse(e.data));
    legendSoon();
  };
}

async function load() {
  const r = await fetch("/api/v1/graph");
  const graph = await r.json();
  seq = graph.seq;
  draw(graph);
  listen();
  document.body.dataset.ready = "true";
}

byId("close").addEventListener("click", () => {
  selected = null;
  byId("panel").hidden = true;
  for (const v of vertices.values()) v.el.classList.remove("selected");
});
load();
