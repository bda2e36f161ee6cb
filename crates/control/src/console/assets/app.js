// flatmesh console: renders the snapshot of /ui/state, live from /ui/events (one per second).
// Plain JS, no libraries. The graph is redrawn only when its services or edges change (else
// only its labels are updated); tables reuse their rows by key.
"use strict";

const COL_W = 340, ROW_H = 46, MAX_ROWS = 14, PAD = 30, R = 9;
const LABELS_UP_TO = 120; // edge labels drawn for at most this many edges (others: hover)

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
const pct = (x) => (x == null ? "-" : (x * 100).toFixed(x === 1 ? 0 : 1) + "%");
const ms = (x) => (x == null ? "-" : x < 1 ? (x * 1000).toFixed(0) + " µs" : x.toFixed(1) + " ms");
const rps = (x) => (x >= 100 ? x.toFixed(0) : x.toFixed(1));

// Layout, O(V + E): columns by BFS depth from the services nothing calls (ingress first);
// within a column, by name, wrapping into sub-columns of MAX_ROWS.
function layout(services, edges) {
  const out = new Map(), indeg = new Map();
  for (const s of services) { out.set(s.name, []); indeg.set(s.name, 0); }
  for (const e of edges) {
    if (!out.has(e.from) || !out.has(e.to) || e.from === e.to) continue;
    out.get(e.from).push(e.to);
    indeg.set(e.to, indeg.get(e.to) + 1);
  }
  const depth = new Map(), queue = [];
  for (const s of services) if (indeg.get(s.name) === 0) { depth.set(s.name, 0); queue.push(s.name); }
  for (let i = 0; i < queue.length; i++) {
    const d = depth.get(queue[i]);
    for (const t of out.get(queue[i])) if (!depth.has(t)) { depth.set(t, d + 1); queue.push(t); }
  }
  for (const s of services) if (!depth.has(s.name)) depth.set(s.name, 1); // in a cycle only
  const columns = [];
  for (const s of services) {
    const d = depth.get(s.name);
    (columns[d] = columns[d] || []).push(s.name);
  }
  const pos = new Map();
  let x = PAD, height = 0;
  for (const col of columns) {
    if (!col) continue;
    col.sort();
    const sub = Math.ceil(col.length / MAX_ROWS);
    col.forEach((name, i) => {
      const c = Math.floor(i / MAX_ROWS), r = i % MAX_ROWS;
      pos.set(name, { x: x + c * COL_W, y: PAD + r * ROW_H });
      height = Math.max(height, PAD + r * ROW_H);
    });
    x += sub * COL_W;
  }
  return { pos, width: x + PAD, height: height + 2 * PAD };
}

let graphKey = "", edgeLabels = new Map(), nodeTitles = new Map();

function edgeText(e) {
  return `${rps(e.rps)} req/s · ${pct(e.success)} · p99 ${ms(e.p99_ms)}` + (e.tiers.length ? ` · ${e.tiers.join("/")}` : "");
}

function drawGraph(snap) {
  const svg = $("service-graph");
  const key = snap.services.map((s) => s.name).join("\n") + "\n--\n" + snap.edges.map((e) => e.from + ">" + e.to).join("\n");
  if (key !== graphKey) {
    graphKey = key;
    const { pos, width, height } = layout(snap.services, snap.edges);
    const parts = [`<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0,0L10,5L0,10z" fill="#8a96a3"/></marker></defs>`];
    const labels = snap.edges.length <= LABELS_UP_TO;
    snap.edges.forEach((e, i) => {
      const a = pos.get(e.from), b = pos.get(e.to);
      if (!a || !b) return;
      const mx = (a.x + b.x) / 2, my = (a.y + b.y) / 2 - (a.x === b.x ? 0 : 14);
      // The label sits just before the arrow head: callees have rows of their own.
      const lx = a.x === b.x ? a.x + 70 : b.x - R - 8, ly = a.x === b.x ? (a.y + b.y) / 2 : b.y - 5;
      const d = a.x === b.x
        ? `M${a.x + R},${a.y} C${a.x + 60},${a.y} ${b.x + 60},${b.y} ${b.x + R},${b.y}`
        : `M${a.x + R},${a.y} Q${mx},${my} ${b.x - R - 2},${b.y}`;
      parts.push(`<g class="edge" data-edge="${esc(e.from + "->" + e.to)}" data-from="${esc(e.from)}" data-to="${esc(e.to)}"><path d="${d}"/><title id="et${i}"></title>` +
        (labels ? `<text id="el${i}" x="${lx}" y="${ly}" text-anchor="${a.x === b.x ? "start" : "end"}"></text>` : "") + `</g>`);
    });
    snap.services.forEach((s, i) => {
      const p = pos.get(s.name);
      parts.push(`<g class="svc${s.name === "ingress" ? " ingress" : ""}" data-service="${esc(s.name)}" transform="translate(${p.x},${p.y})"><circle r="${R}"/>` +
        `<text x="${R + 5}" y="4">${esc(s.name)}</text><title id="nt${i}"></title></g>`);
    });
    svg.setAttribute("width", width);
    svg.setAttribute("height", height);
    svg.innerHTML = parts.join("");
    edgeLabels = new Map(); nodeTitles = new Map();
    snap.edges.forEach((e, i) => edgeLabels.set(e.from + ">" + e.to, [$("el" + i), $("et" + i), svg.querySelector(`[data-edge="${CSS.escape(e.from + "->" + e.to)}"]`)]));
    snap.services.forEach((s, i) => nodeTitles.set(s.name, $("nt" + i)));
  }
  for (const e of snap.edges) {
    const [label, title, g] = edgeLabels.get(e.from + ">" + e.to) || [];
    const text = edgeText(e);
    if (label && label.textContent !== text) label.textContent = text;
    if (title && title.textContent !== text) title.textContent = `${e.from} → ${e.to}: ${text}`;
    if (g) g.classList.toggle("bad", e.success != null && e.success < 0.99);
  }
  for (const s of snap.services) {
    const t = nodeTitles.get(s.name);
    const text = `${s.name}: ${rps(s.rps_in)} req/s in`;
    if (t && t.textContent !== text) t.textContent = text;
  }
}

// Keeps one <tr> per key, updating only the cells whose text changed.
function syncRows(tbody, rows, keyOf, cellsOf) {
  const old = new Map();
  for (const tr of tbody.children) old.set(tr.dataset.key, tr);
  rows.forEach((row, i) => {
    const key = keyOf(row);
    let tr = old.get(key);
    old.delete(key);
    const cells = cellsOf(row);
    if (!tr) {
      tr = document.createElement("tr");
      tr.dataset.key = key;
      for (const c of cells) {
        const td = document.createElement("td");
        if (c.num) td.className = "num";
        tr.appendChild(td);
      }
    }
    cells.forEach((c, j) => {
      const td = tr.children[j];
      if (td.textContent !== c.text) td.textContent = c.text;
      const cls = (c.num ? "num " : "") + (c.cls || "");
      if (td.className !== cls.trim()) td.className = cls.trim();
    });
    if (tbody.children[i] !== tr) tbody.insertBefore(tr, tbody.children[i] || null);
  });
  for (const tr of old.values()) tr.remove();
}

const ROUTE_ROWS = 200; // rows drawn; the snapshot may carry more

function drawTables(snap) {
  syncRows($("routes"), snap.routes.slice(0, ROUTE_ROWS), (r) => [r.node, r.listener, r.route, r.cluster].join("|"), (r) => [
    { text: r.service }, { text: r.node }, { text: r.listener }, { text: r.route }, { text: r.tier },
    { text: rps(r.rps), num: true }, { text: pct(r.success), num: true }, { text: ms(r.p99_ms), num: true },
  ]);
  syncRows($("nodes"), snap.nodes, (n) => n.id, (n) => [
    { text: n.id }, { text: n.kind }, { text: n.up ? "up" : "down", cls: n.up ? "up" : "down" },
    { text: n.heartbeat_age_ms == null ? "never" : n.heartbeat_age_ms + " ms", num: true },
    { text: String(n.instances), num: true },
    { text: n.admin_error ? "unreachable: " + n.admin_error : n.admin || "-", cls: n.admin_error ? "down" : "" },
  ]);
  $("no-certificates").hidden = snap.certificates.length > 0;
  const now = snap.generated_unix_ms / 1000;
  syncRows($("certificates"), snap.certificates, (c) => c.name, (c) => {
    const days = (c.expires_unix - now) / 86400;
    return [{ text: c.name }, { text: new Date(c.expires_unix * 1000).toISOString().replace(".000", "") },
      { text: days < 0 ? "expired" : days < 2 ? (days * 24).toFixed(1) + " h" : days.toFixed(0) + " d", cls: days < 1 ? "down" : "" }];
  });
}

let placementKey = "";

function drawPlacement(snap) {
  const moved = new Set(snap.timeline.filter((t) => t.kind === "migrated" || t.kind === "failed_over").map((t) => t.instance));
  const key = snap.placement.map((p) => p.instance + "@" + p.node).join(",") + "|" + snap.nodes.map((n) => n.id).join(",") + "|" + [...moved].join(",");
  if (key === placementKey) return;
  placementKey = key;
  const byNode = new Map(snap.nodes.map((n) => [n.id, { kind: n.kind, items: [] }]));
  for (const p of snap.placement) {
    if (!byNode.has(p.node)) byNode.set(p.node, { kind: p.kind, items: [] });
    byNode.get(p.node).items.push(p.instance);
  }
  $("placement").innerHTML = [...byNode].map(([node, v]) =>
    `<div class="node-card ${esc(v.kind)}" data-node="${esc(node)}"><h3>${esc(node)} <small>${esc(v.kind)}</small></h3>` +
    v.items.map((i) => `<span class="chip${moved.has(i) ? " moved" : ""}" data-instance="${esc(i)}">${esc(i)}</span>`).join("") + "</div>").join("");
}

let timelineCount = 0, timelineFirst = null;

function drawTimeline(snap) {
  const list = $("timeline"), t = snap.timeline;
  const first = t.length ? t[0].at_unix_ms + t[0].text : null;
  if (first !== timelineFirst) { list.innerHTML = ""; timelineCount = 0; timelineFirst = first; }
  const start = t.length ? t[0].at_unix_ms : 0;
  for (const e of t.slice(timelineCount)) {
    const li = document.createElement("li");
    li.dataset.kind = e.kind;
    if (e.instance) li.dataset.instance = e.instance;
    li.innerHTML = `<span class="t">${new Date(e.at_unix_ms).toISOString().slice(11, 19)}</span>`;
    li.appendChild(document.createTextNode(e.text));
    list.insertBefore(li, list.firstChild); // newest first
  }
  timelineCount = t.length;
  // The strip: every entry since the first, migrations tall.
  const strip = $("timeline-strip"), w = strip.clientWidth || 400;
  const span = Math.max(1, snap.generated_unix_ms - start);
  strip.innerHTML = `<line x1="0" y1="26" x2="${w}" y2="26" stroke="#ccc"/>` + t.map((e) => {
    const x = Math.min(w - 2, ((e.at_unix_ms - start) / span) * (w - 4) + 2);
    const big = e.kind === "migrated" || e.kind === "failed_over";
    const color = big ? "#b06000" : e.kind === "detected" ? "#d93025" : "#8a96a3";
    return `<line x1="${x}" x2="${x}" y1="${big ? 4 : 18}" y2="30" stroke="${color}" stroke-width="${big ? 3 : 1}"><title>${esc(e.text)}</title></line>`;
  }).join("");
}

function render(snap) {
  drawGraph(snap);
  drawTables(snap);
  drawPlacement(snap);
  drawTimeline(snap);
  const tr = snap.truncated, left = Object.entries(tr).filter(([, n]) => n > 0);
  $("truncated").textContent = left.length ? "not shown (over the limits): " + left.map(([k, n]) => `${n} ${k}`).join(", ") : "";
  $("status").textContent = "live · " + new Date(snap.generated_unix_ms).toISOString().slice(11, 19);
  $("status").className = "status live";
}

function connect() {
  fetch("/ui/state").then((r) => r.json()).then(render).catch(() => {});
  const source = new EventSource("/ui/events");
  source.onmessage = (m) => render(JSON.parse(m.data));
  source.onerror = () => { $("status").textContent = "connection lost; retrying"; $("status").className = "status lost"; };
}

connect();
