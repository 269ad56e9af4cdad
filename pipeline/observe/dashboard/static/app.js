// The dashboard page: polls /api/snapshot and redraws the tables and the SVG charts.
// Plain DOM and SVG, no libraries: the page must work without any network access.
"use strict";

const POLL_MS = 1000;
const COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"];
const SVG = "http://www.w3.org/2000/svg";

function fmt(v, digits) {
  if (typeof v !== "number" || !isFinite(v)) return v === undefined || v === null ? "-" : String(v);
  return digits === undefined ? String(v) : v.toFixed(digits);
}

function cell(row, field, value, digits) {
  const td = document.createElement("td");
  td.dataset.field = field;
  td.textContent = fmt(value, digits);
  row.appendChild(td);
}

function renderSummary(snap) {
  const tr = snap.trainer, st = snap.stats;
  const values = {
    version: fmt(tr.version, 0), steps: fmt(tr.steps, 0), state: fmt(tr.state),
    reward_mean: fmt(tr.reward_mean, 3), sample_accuracy: fmt(tr.sample_accuracy, 3),
    eval_accuracy: fmt(tr.eval_accuracy, 3), base_accuracy: fmt(tr.base_accuracy, 3),
    goodput: fmt(snap.goodput, 3), dropped_stale_total: fmt(st.dropped_stale_total || 0, 0),
    dead_letters_total: fmt(st.dead_letters_total || 0, 0),
  };
  document.getElementById("ns").textContent = snap.ns;
  for (const el of document.querySelectorAll("#summary [data-field]")) {
    el.textContent = values[el.dataset.field];
  }
}

// Multi-turn episodes (docs/observing.md, "Episodes"): shown only when the run has some.
function renderEpisodes(data) {
  const ep = data.snapshot.episodes, section = document.getElementById("episodes");
  section.hidden = !ep;
  if (!ep) return;
  const ms = v => (typeof v === "number" ? fmt(1000 * v, 1) : "-");
  const values = {
    episodes: fmt(ep.episodes, 0), episodes_finished: fmt(ep.episodes_finished, 0),
    episodes_per_s: fmt(data.rates.episodes, 2), turns_per_episode: fmt(ep.turns_per_episode, 3),
    env_step_mean_ms: ms(ep.env_step_mean_s), env_step_p50_ms: ms(ep.env_step_p50_s),
    env_step_p95_ms: ms(ep.env_step_p95_s), env_errors: fmt(ep.env_errors, 0),
    tool_calls: fmt(ep.tool_calls, 0), tool_calls_per_episode: fmt(ep.tool_calls_per_episode, 3),
    tool_call_rate: fmt(ep.tool_call_rate, 3), tool_call_success: fmt(ep.tool_call_success, 3),
  };
  for (const el of document.querySelectorAll("#episodes-summary [data-field]")) {
    el.textContent = values[el.dataset.field];
  }
  const step = x => "step " + fmt(x, 0);
  const points = xs => xs.map((v, i) => [i + 1, v]).filter(p => typeof p[1] === "number" && isFinite(p[1]));
  lineChart(document.getElementById("chart-episodes"), [
    {name: "tool-call rate", points: points(data.history.tool_call_rate || [])},
    {name: "env reward", points: points(data.history.env_reward || [])},
  ], {y0: 0, y1: 1, digits: 1, xlabel: step});
}

function renderStreams(snap, rates) {
  const body = document.querySelector("#streams tbody");
  body.replaceChildren();
  for (const s of snap.streams) {
    const groups = s.groups.length ? s.groups : [null];
    for (const g of groups) {
      const row = document.createElement("tr");
      row.dataset.stream = s.stream;
      row.dataset.group = g ? g.group : "";
      cell(row, "stream", s.stream);
      cell(row, "group", g ? g.group : "-");
      cell(row, "length", s.length);
      cell(row, "lag", g ? g.lag : "-");
      cell(row, "pending", g ? g.pending : "-");
      cell(row, "oldest_pending_age_s", g && g.pending ? g.oldest_pending_age_s : "-", 1);
      cell(row, "consumers", g ? g.consumers : "-");
      cell(row, "rate_in", rates.in[s.stream], 1);
      cell(row, "rate_out", g ? rates.out[s.stream + "/" + g.group] : "-", 1);
      body.appendChild(row);
    }
  }
}

function renderWorkers(snap, rates) {
  const body = document.querySelector("#workers tbody");
  body.replaceChildren();
  for (const w of snap.workers) {
    const row = document.createElement("tr");
    row.dataset.worker = w.worker;
    if (w.age_s > 30) row.className = "stale";
    cell(row, "worker", w.worker);
    cell(row, "stage", w.stage);
    cell(row, "state", w.state);
    cell(row, "pid", w.pid);
    cell(row, "age_s", w.age_s, 1);
    cell(row, "version", w.version);
    cell(row, "groups", w.groups !== undefined ? w.groups : w.issued);
    cell(row, "rate", rates.workers[w.worker], 1);
    body.appendChild(row);
  }
}

function el(name, attrs, text) {
  const e = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

// series: [{name, points: [[x, y], ...]}]; draws axes, a legend and one polyline per series.
function lineChart(svg, series, opts) {
  const W = 480, H = 200, L = 40, R = 10, T = 10, B = 24;
  svg.replaceChildren();
  const all = series.flatMap(s => s.points);
  if (!all.length) { svg.appendChild(el("text", {x: L, y: H / 2}, "no data yet")); return; }
  const xs = all.map(p => p[0]), ys = all.map(p => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs);
  const y0 = opts.y0 !== undefined ? opts.y0 : Math.min(...ys);
  const y1 = opts.y1 !== undefined ? opts.y1 : Math.max(...ys, y0 + 1);
  const sx = x => L + (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5) * (W - L - R);
  const sy = y => H - B - (y1 > y0 ? (y - y0) / (y1 - y0) : 0) * (H - T - B);
  svg.appendChild(el("line", {class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B}));
  svg.appendChild(el("line", {class: "axis", x1: L, y1: T, x2: L, y2: H - B}));
  svg.appendChild(el("text", {x: 2, y: T + 8}, fmt(y1, opts.digits)));
  svg.appendChild(el("text", {x: 2, y: H - B}, fmt(y0, opts.digits)));
  svg.appendChild(el("text", {x: L, y: H - 6}, opts.xlabel(x0)));
  svg.appendChild(el("text", {x: W - R, y: H - 6, "text-anchor": "end"}, opts.xlabel(x1)));
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const pts = s.points.map(p => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" ");
    svg.appendChild(el("polyline", {class: "line", points: pts, stroke: color, "data-series": s.name}));
    svg.appendChild(el("text", {x: L + 8 + 110 * i, y: T + 8, fill: color}, s.name));
  });
}

function barChart(svg, counts) {
  const W = 480, H = 200, L = 40, B = 24, T = 10;
  svg.replaceChildren();
  if (!counts.length) { svg.appendChild(el("text", {x: L, y: H / 2}, "no data yet")); return; }
  const max = Math.max(...counts, 1), w = (W - L - 10) / counts.length;
  counts.forEach((n, i) => {
    const h = (n / max) * (H - T - B);
    svg.appendChild(el("rect", {class: "bar", x: L + i * w + 2, y: H - B - h, width: Math.max(1, w - 4), height: h,
                                "data-staleness": i, "data-count": n}));
    svg.appendChild(el("text", {x: L + i * w + w / 2, y: H - 6, "text-anchor": "middle"}, String(i)));
    svg.appendChild(el("text", {x: L + i * w + w / 2, y: H - B - h - 2, "text-anchor": "middle"}, String(n)));
  });
}

function renderCharts(data) {
  const t0 = data.samples.length ? data.samples[0].time : 0;
  const seconds = x => (x - t0).toFixed(0) + " s";
  const names = data.samples.length ? Object.keys(data.samples[data.samples.length - 1].queues) : [];
  lineChart(document.getElementById("chart-queues"),
    names.filter(n => n !== "dead").map(n => ({name: n, points: data.samples.map(
      s => [s.time, (s.queues[n] || {lag: 0}).lag + (s.queues[n] || {pending: 0}).pending])})),
    {y0: 0, digits: 0, xlabel: seconds});
  const step = x => "step " + fmt(x, 0);
  lineChart(document.getElementById("chart-reward"), [
    {name: "reward", points: data.history.reward.map((v, i) => [i + 1, v])},
    {name: "sample accuracy", points: data.history.sample_accuracy.map((v, i) => [i + 1, v])},
  ], {y0: 0, y1: 1, digits: 1, xlabel: step});
  lineChart(document.getElementById("chart-heldout"),
    [{name: "held-out accuracy", points: data.history.heldout}], {y0: 0, y1: 1, digits: 1, xlabel: step});
  barChart(document.getElementById("chart-staleness"), data.history.staleness);
}

async function poll() {
  try {
    const resp = await fetch("/api/snapshot", {cache: "no-store"});
    const data = await resp.json();
    renderSummary(data.snapshot);
    renderStreams(data.snapshot, data.rates);
    renderWorkers(data.snapshot, data.rates);
    renderCharts(data);
    renderEpisodes(data);
    const status = document.getElementById("status");
    status.textContent = "updated " + new Date(data.snapshot.time * 1000).toISOString();
    status.dataset.time = data.snapshot.time;
  } catch (err) {
    document.getElementById("status").textContent = "cannot reach the dashboard server: " + err;
  }
  setTimeout(poll, POLL_MS);
}

poll();
