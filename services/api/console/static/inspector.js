// pagoda console: the request inspector. This api process's requests in flight and its last N finished ones;
// each with its timeline (arrived, tokenized, queued, scheduled, preempted / rescheduled, first token, finished).
(() => {
"use strict";

const $ = PG.$;
const Inspect = { requests: [], selected: null, polls: 0, timer: null };
PG.inspect = Inspect;
const POLL_MS = 2000;
const COLORS = { tokenize: "#98a2b3", waiting: "#c77c02", prefill: "#a855f7", "waiting + prefill": "#a855f7",
  decode: "#2f6fde" };

async function poll() {
  try {
    const data = await PG.json("/console/api/requests");
    Inspect.requests = data.requests;
    Inspect.polls += 1;
    $("req-hint").textContent = `This api process's requests: in flight, then the last ${data.max_requests} finished. `
      + (data.show_prompts ? "Prompts are shown (--console-show-prompts)." : "Prompt text is not kept (start with --console-show-prompts to see it).");
    render();
  } catch (error) {
    $("req-hint").textContent = error.message;
  }
}

// [label, from ms, to ms]: the tokenizer sends a request on before it answers the api, so the scheduler's
// "queued" (when known) ends tokenization
function phases(r) {
  const admitted = event(r, "queued") ?? event(r, "tokenized");
  const scheduled = event(r, "scheduled"), first = event(r, "first token");
  const middle = scheduled === null ? [["waiting + prefill", admitted, first]]
    : [["waiting", admitted, scheduled], ["prefill", scheduled, first]];
  return [["tokenize", 0, admitted], ...middle, ["decode", first, event(r, "finished")]];
}

function event(request, name) {
  const found = request.timeline.find((e) => e.event === name);
  return found ? found.ms : null;
}

function render() {
  const body = $("req-table").querySelector("tbody");
  body.replaceChildren(...Inspect.requests.map((r) => {
    const first = event(r, "first token"), end = event(r, "finished");
    const row = PG.el("tr", { "data-id": r.id, "data-status": r.status },
      PG.el("td", { text: r.id.slice(0, 18), title: r.id }), PG.el("td", { text: r.route }));
    const cell = PG.el("td"), pill = PG.el("span");
    PG.setState(pill, r.status);
    cell.append(pill);
    row.append(cell, PG.el("td", { text: new Date(r.arrived_at * 1000).toLocaleTimeString() }),
      PG.el("td", { text: String(r.prompt_tokens) }), PG.el("td", { text: String(r.completion_tokens) }),
      PG.el("td", { text: String(r.cached_tokens) }), PG.el("td", { text: PG.ms(first) }), PG.el("td", { text: PG.ms(end) }),
      PG.el("td", { text: String(r.timeline.filter((e) => e.event === "preempted").length) }),
      PG.el("td", { text: r.finish_reasons.join(", ") }));
    if (r.id === Inspect.selected) row.classList.add("selected");
    row.addEventListener("click", () => { Inspect.selected = r.id; render(); });
    return row;
  }));
  const chosen = Inspect.requests.find((r) => r.id === Inspect.selected);
  if (chosen) showDetail(chosen);
}

function showDetail(r) {
  const box = $("req-detail");
  box.replaceChildren(PG.el("h3", { text: r.id }));
  const facts = [`${r.route}${r.stream ? ", streamed" : ""}`, `n=${r.n}`, `max_tokens=${r.max_tokens ?? "none"}`];
  if (r.constraint) facts.push(`constrained: ${r.constraint}`);
  if (r.num_prompts > 1) facts.push(`${r.num_prompts} prompts (timeline of the first)`);
  box.append(PG.el("div", { text: facts.join(" · ") }));
  if (r.error) box.append(PG.el("div", { class: "error", text: r.error }));
  const end = Math.max(1, ...r.timeline.map((e) => e.ms));
  const bar = PG.el("div", { class: "timeline", id: "req-timeline" });
  const legend = PG.el("div", { class: "legend" });
  for (const [label, a, b] of phases(r)) {
    if (a === null || b === null || b < a) continue;
    const color = COLORS[label];
    const seg = PG.el("div", { class: "seg", title: `${label}: ${PG.ms(b - a)}` });
    seg.style.left = (100 * a) / end + "%";
    seg.style.width = Math.max(0.4, (100 * (b - a)) / end) + "%";
    seg.style.background = color;
    bar.append(seg);
    const key = PG.el("span");
    key.append(PG.el("i"), `${label} ${PG.ms(b - a)}`);
    key.firstChild.style.background = color;
    legend.append(key);
  }
  for (const e of r.timeline.filter((x) => x.event === "preempted" || x.event === "rescheduled")) {
    const mark = PG.el("div", { class: "mark " + e.event, title: `${e.event} at ${PG.ms(e.ms)}` });
    mark.style.left = (100 * e.ms) / end + "%";
    bar.append(mark);
  }
  box.append(bar, legend);
  const table = PG.el("table", { class: "events", id: "req-events" });
  for (const e of r.timeline) table.append(PG.el("tr", { "data-event": e.event }, PG.el("td", { text: e.event }), PG.el("td", { text: "+" + PG.ms(e.ms) })));
  box.append(table);
  box.append(PG.el("div", { text: `tokens: ${r.prompt_tokens} prompt (${r.cached_tokens} from the prefix cache), ${r.completion_tokens} generated` }));
  if (r.prompt !== undefined) box.append(PG.el("pre", { text: r.prompt }));
}

function schedule(name) {
  clearInterval(Inspect.timer);
  Inspect.timer = null;
  if (name === "requests" && PG.info) {
    poll();
    Inspect.timer = setInterval(poll, POLL_MS);
  }
}

PG.onTab.push(schedule);
PG.onBoot.push(() => schedule(PG.tab));
})();
