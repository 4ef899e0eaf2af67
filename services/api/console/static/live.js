// pagoda console: the live view. One SSE stream from /console/api/stream: ten minutes of history first, then a
// snapshot a second (throughput, queues, KV blocks, prefix hits, step time split, latency percentiles, every
// process and replica with its state, tenants once the server reports them).
(() => {
"use strict";

const $ = PG.$;
const Live = { history: { fields: [], rows: [] }, latest: null, ticks: 0, connected: false, running: false, charts: [] };
PG.live = Live;
const MAX_ROWS = 600;
const RECONNECT_MS = 2000;

function makeCharts() {
  const c = (id, series, options) => new PG.Chart($(id), series, options);
  Live.charts = [
    c("chart-tokens", [{ label: "output", color: "#2f6fde", field: "tokens_out_per_s" },
      { label: "prompt", color: "#a855f7", field: "tokens_in_per_s" }]),
    c("chart-requests", [{ label: "running", color: "#1f9d55", field: "running" },
      { label: "waiting", color: "#c77c02", field: "waiting" }, { label: "preempted", color: "#d14343", field: "preempted" }]),
    c("chart-kv", [{ label: "KV used", color: "#2f6fde", field: "kv_used_frac", scale: 100 },
      { label: "prefix hits", color: "#1f9d55", field: "prefix_hit_rate", scale: 100 }], { max: 100, unit: "%" }),
    c("chart-split", [{ label: "prefill", color: "#a855f7", field: "prefill_frac", scale: 100 },
      { label: "decode", color: "#2f6fde", field: "decode_frac", scale: 100 },
      { label: "host", color: "#c77c02", field: "host_frac", scale: 100 }], { max: 100, unit: "%" }),
    c("chart-ttft", [{ label: "p50", color: "#2f6fde", field: "ttft_p50_ms" }, { label: "p99", color: "#d14343", field: "ttft_p99_ms" }]),
    c("chart-itl", [{ label: "p50", color: "#2f6fde", field: "itl_p50_ms" }, { label: "p99", color: "#d14343", field: "itl_p99_ms" }]),
  ];
}

// the rows plus a derived KV-used fraction column (rates and shares come averaged over 5 s from the server)
function chartData() {
  const fields = Live.history.fields.concat(["kv_used_frac"]);
  const used = Live.history.fields.indexOf("kv_blocks_used"), total = Live.history.fields.indexOf("kv_blocks_total");
  const rows = Live.history.rows.map((row) => row.concat([row[total] ? row[used] / row[total] : null]));
  return { fields, rows };
}

function drawCharts() {
  if (PG.tab !== "live") return;
  const data = chartData();
  for (const chart of Live.charts) chart.draw(data);
}

function setNumber(id, value, text) {
  const node = $(id);
  node.dataset.value = value === null || value === undefined ? "" : String(value);
  node.textContent = text;
}

function showSnapshot(snap) {
  const e = snap.engine;
  setNumber("live-tokens-out", e.tokens_out_per_s, PG.num(e.tokens_out_per_s));
  setNumber("live-tokens-in", e.tokens_in_per_s, PG.num(e.tokens_in_per_s));
  setNumber("live-requests", e.requests_per_s, PG.num(e.requests_per_s, 1));
  setNumber("live-running", e.running, PG.num(e.running, 0));
  setNumber("live-waiting", e.waiting, PG.num(e.waiting, 0));
  setNumber("live-preempted", e.preempted, PG.num(e.preempted, 0) +
    (e.preemptions_per_s ? ` (${PG.num(e.preemptions_per_s, 1)}/s)` : ""));
  setNumber("live-kv", e.kv_blocks_used, `${PG.num(e.kv_blocks_used, 0)} / ${PG.num(e.kv_blocks_total, 0)}`);
  setNumber("live-prefix", e.prefix_hit_rate, PG.pct(e.prefix_hit_rate === null ? e.prefix_hit_rate_total : e.prefix_hit_rate));
  const lat = (q) => `${PG.ms(q.p50)} / ${PG.ms(q.p90)} / ${PG.ms(q.p99)}`;
  $("live-ttft").textContent = lat(snap.latency.ttft_ms) + ` (${PG.num(snap.latency.ttft_ms.count, 0)})`;
  $("live-itl").textContent = lat(snap.latency.itl_ms);
  $("live-split").textContent = `${PG.pct(e.prefill_frac)} / ${PG.pct(e.decode_frac)} / ${PG.pct(e.host_frac)}`;
  showProcesses(snap.processes);
  showReplicas(snap.replicas);
  showTenants(snap.tenants || []);
  const health = snap.health || { status: "ok", problems: [] };
  PG.setState($("health"), health.status === "ok" ? "ok" : "unavailable", health.status === "ok" ? "healthy" : "unavailable");
  $("health").title = health.problems.join("\n") || "server health";
  $("live-problems").textContent = health.problems.join("\n");
}

function stateCell(state) {
  const cell = PG.el("td");
  const pill = PG.el("span");
  PG.setState(pill, state);
  cell.append(pill);
  return cell;
}

function showProcesses(processes) {
  const body = $("live-processes").querySelector("tbody");
  body.replaceChildren(...processes.map((p) => {
    const row = PG.el("tr", { "data-name": p.name, "data-state": p.state },
      PG.el("td", { text: p.name }), PG.el("td", { text: p.kind }),
      PG.el("td", { text: p.replica === null || p.replica === undefined ? "" : String(p.replica) }),
      PG.el("td", { text: p.pid ? String(p.pid) : "" }));
    row.append(stateCell(p.state), PG.el("td", { text: String(p.restarts) }), PG.el("td", { text: p.detail }));
    return row;
  }));
}

function showReplicas(replicas) {
  const body = $("live-replicas").querySelector("tbody");
  body.replaceChildren(...replicas.map((r) => {
    const row = PG.el("tr", { "data-replica": r.id }, PG.el("td", { text: r.id }));
    row.append(stateCell(r.state), PG.el("td", { text: String(r.running) }), PG.el("td", { text: String(r.waiting) }),
      PG.el("td", { text: PG.pct(r.kv_usage) }), PG.el("td", { text: r.detail }));
    return row;
  }));
}

// per-tenant usage: shown once the server reports tenants
function showTenants(tenants) {
  $("live-tenants-box").hidden = tenants.length === 0;
  $("live-tenants").querySelector("tbody").replaceChildren(...tenants.map((t) => PG.el("tr", { "data-tenant": t.name },
    PG.el("td", { text: t.name }), PG.el("td", { text: String(t.running) }), PG.el("td", { text: String(t.waiting) }),
    PG.el("td", { text: PG.num(t.requests_per_s, 1) }), PG.el("td", { text: PG.num(t.tokens_in_per_s) }),
    PG.el("td", { text: PG.num(t.tokens_out_per_s) }), PG.el("td", { text: PG.num(t.rejected_per_s, 1) }))));
}

function onEvent(name, data) {
  const payload = JSON.parse(data);
  if (name === "history") {
    Live.history = payload.history;
    if (payload.latest && payload.latest.engine) { Live.latest = payload.latest; showSnapshot(payload.latest); }
  } else if (name === "tick") {
    Live.latest = payload;
    Live.ticks += 1;
    Live.history.rows.push(payload.row);
    if (Live.history.rows.length > MAX_ROWS) Live.history.rows.splice(0, Live.history.rows.length - MAX_ROWS);
    showSnapshot(payload);
  }
  drawCharts();
}

async function connect() {
  if (Live.running) return;
  Live.running = true;
  for (;;) {
    try {
      const response = await PG.fetch("/console/api/stream");
      if (!response.ok) throw new Error(await PG.errorText(response));
      Live.connected = true;
      await PG.readSSE(response, onEvent);
    } catch (error) {
      if (error instanceof AuthError) { Live.connected = false; Live.running = false; return; }
    }
    Live.connected = false;
    PG.setState($("health"), "unavailable", "reconnecting");
    await new Promise((resolve) => setTimeout(resolve, RECONNECT_MS));
  }
}

makeCharts();
PG.onTab.push((name) => { if (name === "live") drawCharts(); });
window.addEventListener("resize", drawCharts);
PG.onBoot.push(connect);
})();
