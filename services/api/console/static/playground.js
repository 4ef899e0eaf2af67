// pagoda console: the playground. Chat and completion requests streamed from the server's own OpenAI routes,
// with sampling fields, constraints and tools; TTFT, decode rate and finish reason per response; an optional
// per-token view coloured by probability (alternatives on hover); the request shown as curl and Python.
(() => {
"use strict";

const $ = PG.$;
const Play = {
  messages: [],  // the chat so far: {role, content, tool_calls?}
  completionPrompt: "",
  controller: null,
  last: null,  // {mode, path, body} of the latest request (regenerate, snippet)
  lang: "curl",
  view: null,  // the response being shown (see newView)
  status: "idle",
  numResponses: 0,
};
PG.play = Play;

const CHAT_SDK_FIELDS = new Set(["model", "messages", "temperature", "top_p", "max_tokens", "seed", "stop",
  "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
  "stream", "stream_options", "n", "logit_bias"]);
const COMPLETION_SDK_FIELDS = new Set(["model", "prompt", "temperature", "top_p", "max_tokens", "seed", "stop",
  "presence_penalty", "frequency_penalty", "logprobs", "stream", "stream_options", "n", "logit_bias", "echo"]);

// ---------------------------------------------------------------- the request

function numberField(id) {
  const text = $(id).value.trim();
  return text === "" ? null : Number(text);
}

function parseJSON(text, what) {
  try {
    return JSON.parse(text);
  } catch (error) {
    throw new Error(`${what} is not valid JSON: ${error.message}`);
  }
}

// The sampling, constraint and tool fields both modes share (only values that differ from the defaults).
function commonFields(mode) {
  const body = { model: PG.info ? PG.info.model : undefined };
  const fields = [["temperature", "pg-temperature", 1], ["top_p", "pg-top-p", 1], ["top_k", "pg-top-k", 0],
    ["min_p", "pg-min-p", 0], ["presence_penalty", "pg-presence", 0], ["frequency_penalty", "pg-frequency", 0],
    ["repetition_penalty", "pg-repetition", 1]];
  for (const [name, id, neutral] of fields) {
    const value = numberField(id);
    if (value !== null && (value !== neutral || name === "temperature")) body[name] = value;
  }
  body.max_tokens = numberField("pg-max-tokens") || 256;
  const seed = numberField("pg-seed");
  if (seed !== null) body.seed = seed;
  const stops = $("pg-stop").value.split("\n").filter((s) => s.length > 0);
  if (stops.length) body.stop = stops;
  if ($("pg-logprobs").checked) {
    const k = Math.max(0, Math.min(5, numberField("pg-top-logprobs") || 0));
    if (mode === "chat") { body.logprobs = true; body.top_logprobs = k; } else { body.logprobs = k; }
  }
  const kind = $("pg-constraint").value, text = $("pg-constraint-text").value;
  if (kind === "json") {
    const schema = parseJSON(text, "The JSON schema");
    if (mode === "chat") body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
    else body.structured_outputs = { json: schema };
  } else if (kind === "regex") {
    body.structured_outputs = { regex: text };
  } else if (kind === "choice") {
    body.structured_outputs = { choice: text.split("\n").map((s) => s.trim()).filter((s) => s) };
  }
  const tools = $("pg-tools").value.trim();
  if (mode === "chat" && tools) {
    body.tools = parseJSON(tools, "The tools");
    body.tool_choice = $("pg-tool-choice").value;
  }
  body.stream = true;
  body.stream_options = { include_usage: true };
  return body;
}

function chatRequest() {
  const system = $("pg-system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(Play.messages);
  return { mode: "chat", path: "/v1/chat/completions", body: Object.assign({ messages }, commonFields("chat")) };
}

function completionRequest() {
  return { mode: "completion", path: "/v1/completions",
    body: Object.assign({ prompt: Play.completionPrompt }, commonFields("completion")) };
}

// ---------------------------------------------------------------- sending

async function send() {
  if (Play.controller) return;
  const mode = $("pg-mode").value;
  const input = $("pg-input").value;
  if (mode === "chat") {
    if (input.trim()) Play.messages.push({ role: "user", content: input });
    if (!Play.messages.length || Play.messages[Play.messages.length - 1].role !== "user") return;
  } else {
    Play.completionPrompt = input;
    if (!input) return;
  }
  $("pg-input").value = "";
  await run(mode);
}

async function regenerate() {
  if (Play.controller || !Play.last) return;
  if (Play.last.mode === "chat") {
    while (Play.messages.length && Play.messages[Play.messages.length - 1].role === "assistant") Play.messages.pop();
    if (!Play.messages.length) return;
  }
  await run(Play.last.mode);
}

async function run(mode) {
  $("pg-settings-error").textContent = "";
  let request;
  try {
    request = mode === "chat" ? chatRequest() : completionRequest();
  } catch (error) {
    $("pg-settings-error").textContent = error.message;
    if (mode === "chat" && Play.messages.length && Play.messages[Play.messages.length - 1].role === "user") {
      $("pg-input").value = Play.messages.pop().content;  // give the message back to fix the settings
    }
    renderTranscript();
    return;
  }
  Play.last = request;
  showSnippet();
  const view = newView(mode);
  Play.view = view;
  Play.controller = new AbortController();
  setStatus("waiting");
  renderTranscript();
  view.sentAt = performance.now();
  try {
    const response = await PG.fetch(request.path, { method: "POST", body: JSON.stringify(request.body),
      headers: { "Content-Type": "application/json" }, signal: Play.controller.signal });
    if (!response.ok) throw new Error(await PG.errorText(response));
    await PG.readSSE(response, (name, data) => onChunk(view, data));
    view.doneAt = performance.now();
    setStatus(view.error ? "error" : "done");
  } catch (error) {
    view.doneAt = performance.now();
    if (error.name === "AbortError") {
      view.stopped = true;
      setStatus("stopped");
    } else {
      view.error = view.error || error.message;
      setStatus("error");
    }
  } finally {
    Play.controller = null;
    Play.numResponses += 1;
    if (mode === "chat" && (view.text || view.toolCalls.length)) {
      const message = { role: "assistant", content: view.text };
      if (view.toolCalls.length) message.tool_calls = view.toolCalls.map(toolCallMessage);
      Play.messages.push(message);
      view.committed = true;
    }
    showMetrics(view);
    renderTranscript();
  }
}

function newView(mode) {
  return { mode, text: "", reasoning: "", tokens: [], toolCalls: [], chunks: 0, sentAt: 0, firstAt: null,
    lastAt: null, doneAt: null, finish: null, usage: null, error: "", stopped: false, committed: false };
}

function toolCallMessage(call) {
  return { id: call.id, type: "function", function: { name: call.name, arguments: call.arguments } };
}

function onChunk(view, data) {
  if (data === "[DONE]") return;
  let chunk;
  try { chunk = JSON.parse(data); } catch (error) { return; }
  if (chunk.error) { view.error = chunk.error.message || JSON.stringify(chunk.error); return; }
  if (chunk.usage) view.usage = chunk.usage;
  for (const choice of chunk.choices || []) {
    let news = false;
    if (view.mode === "chat") {
      const delta = choice.delta || {};
      if (delta.content) { view.text += delta.content; news = true; }
      if (delta.reasoning_content) { view.reasoning += delta.reasoning_content; news = true; }
      for (const call of delta.tool_calls || []) { addToolCall(view, call); news = true; }
      const content = choice.logprobs && choice.logprobs.content;
      for (const item of content || []) {
        view.tokens.push({ text: item.token, logprob: item.logprob,
          top: (item.top_logprobs || []).map((t) => ({ token: t.token, logprob: t.logprob })) });
      }
    } else {
      if (choice.text) { view.text += choice.text; news = true; }
      const lp = choice.logprobs;
      if (lp && lp.tokens) {
        lp.tokens.forEach((token, i) => {
          const alternatives = Object.entries((lp.top_logprobs || [])[i] || {}).map(([t, l]) => ({ token: t, logprob: l }));
          alternatives.sort((a, b) => b.logprob - a.logprob);
          view.tokens.push({ text: token, logprob: lp.token_logprobs[i], top: alternatives });
        });
      }
    }
    if (choice.finish_reason) view.finish = choice.finish_reason;
    if (news) {
      view.chunks += 1;
      view.lastAt = performance.now();
      if (view.firstAt === null) { view.firstAt = view.lastAt; setStatus("streaming"); }
    }
  }
  renderStreaming(view);
}

function addToolCall(view, call) {
  const index = call.index || 0;
  const known = view.toolCalls[index] || (view.toolCalls[index] = { id: "", name: "", arguments: "" });
  if (call.id) known.id = call.id;
  if (call.function && call.function.name) known.name += call.function.name;
  if (call.function && call.function.arguments) known.arguments += call.function.arguments;
}

function stop() {
  if (Play.controller) Play.controller.abort();
}

function setStatus(status) {
  Play.status = status;
  $("pg-status").textContent = status;
  const busy = status === "waiting" || status === "streaming";
  $("pg-send").disabled = busy;
  $("pg-stop-button").disabled = !busy;
  $("pg-regenerate").disabled = busy || !Play.last;
}

function showMetrics(view) {
  const usage = view.usage || {};
  $("pg-ttft").textContent = view.firstAt !== null ? PG.ms(view.firstAt - view.sentAt) : "–";
  const decoded = (usage.completion_tokens || 0) - 1;
  const seconds = view.firstAt !== null && view.doneAt !== null ? (view.doneAt - view.firstAt) / 1000 : 0;
  $("pg-tps").textContent = decoded > 0 && seconds > 0 ? PG.num(decoded / seconds) + " tok/s" : "–";
  $("pg-tokens-count").textContent = view.usage ? `${usage.prompt_tokens} in · ${usage.completion_tokens} out`
    + (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens
      ? ` · ${usage.prompt_tokens_details.cached_tokens} cached` : "") : "–";
  $("pg-finish").textContent = view.stopped ? "stopped" : (view.finish || (view.error ? "error" : "–"));
}

// ---------------------------------------------------------------- rendering

function messageNode(role, text, extraClass) {
  const node = PG.el("div", { class: `message ${role}` }, PG.el("div", { class: "role", text: role }));
  node.append(PG.el("div", { class: "body " + (extraClass || ""), text }));
  return node;
}

function renderTranscript() {
  const box = $("pg-transcript");
  box.replaceChildren();
  const mode = $("pg-mode").value;
  const view = Play.view;
  if (mode === "chat") {
    Play.messages.forEach((message, i) => {
      const isLastCommitted = view && view.committed && i === Play.messages.length - 1 && message.role === "assistant";
      box.append(isLastCommitted ? responseNode(view) : historyNode(message));
    });
    if (view && view.mode === "chat" && !view.committed && (Play.controller || view.error || view.stopped)) {
      box.append(responseNode(view));
    }
  } else if (Play.completionPrompt || view) {
    const node = PG.el("div", { class: "message completion" }, PG.el("div", { class: "role", text: "prompt + completion" }));
    node.append(PG.el("span", { class: "body prompt", text: Play.completionPrompt }));
    if (view && view.mode === "completion") node.append(responseBody(view));
    box.append(node);
  }
  box.scrollTop = box.scrollHeight;
}

function historyNode(message) {
  const node = messageNode(message.role, message.content);
  if (message.tool_calls) {
    node.append(PG.el("div", { class: "tool-calls", text: message.tool_calls.map((c) =>
      `${c.function.name}(${c.function.arguments})`).join("\n") }));
  }
  return node;
}

function responseNode(view) {
  const node = PG.el("div", { class: "message assistant", id: "pg-response" }, PG.el("div", { class: "role", text: "assistant" }));
  if (view.reasoning) node.append(PG.el("div", { class: "reasoning", text: view.reasoning }));
  node.append(responseBody(view));
  if (view.toolCalls.length) {
    node.append(PG.el("div", { class: "tool-calls", text: view.toolCalls.map((c) => `${c.name}(${c.arguments})`).join("\n") }));
  }
  if (view.error) node.append(PG.el("div", { class: "err", text: view.error }));
  return node;
}

function responseBody(view) {
  const streaming = Play.controller && Play.view === view;
  const body = PG.el("span", { class: "body output" + (streaming ? " streaming" : ""), id: "pg-output" });
  if ($("pg-logprobs").checked && view.tokens.length) {
    for (let i = 0; i < view.tokens.length; i++) body.append(tokenSpan(view.tokens[i], i));
  } else {
    body.textContent = view.text;
  }
  return body;
}

function tokenSpan(token, index) {
  const p = token.logprob === null || token.logprob === undefined ? 1 : Math.exp(token.logprob);
  const span = PG.el("span", { class: "tok", text: token.text, "data-index": String(index) });
  span.style.background = `hsl(${Math.round(120 * p)}, 75%, ${Math.round(88 - 8 * (1 - p))}%)`;
  return span;
}

// While streaming, only the response's own node changes.
function renderStreaming(view) {
  const old = document.getElementById(view.mode === "chat" ? "pg-response" : "pg-output");
  if (!old) { renderTranscript(); return; }
  old.replaceWith(view.mode === "chat" ? responseNode(view) : responseBody(view));
  $("pg-transcript").scrollTop = $("pg-transcript").scrollHeight;
}

// the alternatives of the token under the pointer
$("pg-transcript").addEventListener("mousemove", (event) => {
  const tip = $("token-tip");
  const span = event.target.closest ? event.target.closest(".tok") : null;
  if (!span || !Play.view) { tip.hidden = true; return; }
  const token = Play.view.tokens[Number(span.dataset.index)];
  if (!token) { tip.hidden = true; return; }
  const table = PG.el("table");
  const seen = new Set();
  const rows = [{ token: token.text, logprob: token.logprob, sampled: true }].concat(token.top);
  for (const alt of rows) {
    if (seen.has(alt.token)) continue;
    seen.add(alt.token);
    const p = alt.logprob === null || alt.logprob === undefined ? null : Math.exp(alt.logprob);
    const row = PG.el("tr", { class: alt.sampled ? "sampled" : "" },
      PG.el("td", { text: JSON.stringify(alt.token) }), PG.el("td", { text: p === null ? "–" : PG.pct(p) }),
      PG.el("td", { text: alt.logprob === null || alt.logprob === undefined ? "" : alt.logprob.toFixed(3) }));
    table.append(row);
  }
  tip.replaceChildren(table);
  tip.hidden = false;
  tip.style.left = Math.min(event.clientX + 12, window.innerWidth - 330) + "px";
  tip.style.top = event.clientY + 14 + "px";
});
$("pg-transcript").addEventListener("mouseleave", () => { $("token-tip").hidden = true; });

// ---------------------------------------------------------------- the request as code

function showSnippet() {
  if (!Play.last) return;
  $("pg-snippet-text").textContent = Play.lang === "curl" ? curlSnippet(Play.last) : pythonSnippet(Play.last);
}

function curlSnippet(request) {
  const json = JSON.stringify(request.body, null, 2).replace(/'/g, "'\\''");
  const auth = PG.info && PG.info.auth ? '  -H "Authorization: Bearer $PAGODA_API_KEY" \\\n' : "";
  return `curl -N ${location.origin}${request.path} \\\n  -H 'Content-Type: application/json' \\\n${auth}  -d '${json}'`;
}

function pythonSnippet(request) {
  const known = request.mode === "chat" ? CHAT_SDK_FIELDS : COMPLETION_SDK_FIELDS;
  const args = [], extra = {};
  for (const [name, value] of Object.entries(request.body)) {
    if (value === undefined) continue;
    if (known.has(name)) args.push(`    ${name}=${py(value, 1)},`);
    else extra[name] = value;
  }
  if (Object.keys(extra).length) args.push(`    extra_body=${py(extra, 1)},  # pagoda / vLLM fields`);
  const call = request.mode === "chat" ? "client.chat.completions.create" : "client.completions.create";
  const read = request.mode === "chat" ? "chunk.choices[0].delta.content or \"\"" : "chunk.choices[0].text";
  return ["import os", "", "from openai import OpenAI", "",
    `client = OpenAI(base_url="${location.origin}/v1", api_key=os.environ.get("PAGODA_API_KEY", "none"))`,
    `stream = ${call}(`, ...args, ")", "for chunk in stream:", "    if chunk.choices:",
    `        print(${read}, end="", flush=True)`, "print()"].join("\n");
}

// JSON value -> Python literal
function py(value, depth) {
  const pad = "    ".repeat(depth + 1), close = "    ".repeat(depth);
  if (value === null) return "None";
  if (value === true) return "True";
  if (value === false) return "False";
  if (typeof value === "number") return String(value);
  if (typeof value === "string") return JSON.stringify(value);
  if (Array.isArray(value)) {
    if (!value.length) return "[]";
    return "[\n" + value.map((v) => pad + py(v, depth + 1) + ",").join("\n") + "\n" + close + "]";
  }
  const entries = Object.entries(value);
  if (!entries.length) return "{}";
  return "{\n" + entries.map(([k, v]) => `${pad}${JSON.stringify(k)}: ${py(v, depth + 1)},`).join("\n") + "\n" + close + "}";
}

for (const button of document.querySelectorAll(".snippet-lang")) {
  button.addEventListener("click", () => {
    Play.lang = button.dataset.lang;
    for (const b of document.querySelectorAll(".snippet-lang")) b.classList.toggle("active", b === button);
    showSnippet();
  });
}
$("pg-copy").addEventListener("click", () => navigator.clipboard && navigator.clipboard.writeText($("pg-snippet-text").textContent));

// ---------------------------------------------------------------- controls

const EXAMPLES = {
  json: JSON.stringify({ type: "object", properties: { name: { type: "string", maxLength: 20 },
    age: { type: "integer", minimum: 0, maximum: 150 } }, required: ["name", "age"] }, null, 2),
  regex: "(yes|no), because [a-z ]{10,40}\\.",
  choice: "positive\nnegative\nneutral",
};

function syncMode() {
  const chat = $("pg-mode").value === "chat";
  $("pg-system-label").hidden = !chat;
  $("pg-tools-label").hidden = !chat;
  $("pg-tool-choice-label").hidden = !chat;
  $("pg-input").placeholder = chat ? "Type a message (Ctrl+Enter sends)" : "Type a prompt to continue (Ctrl+Enter sends)";
  if (!chat && !$("pg-input").value && Play.completionPrompt) $("pg-input").value = Play.completionPrompt;
  Play.view = null;
  renderTranscript();
}

$("pg-mode").addEventListener("change", syncMode);
$("pg-constraint").addEventListener("change", () => {
  const kind = $("pg-constraint").value;
  $("pg-constraint-text").hidden = !kind;
  if (kind) $("pg-constraint-text").value = EXAMPLES[kind];
});
$("pg-logprobs").addEventListener("change", () => { if (Play.view) renderTranscript(); });
$("pg-send").addEventListener("click", send);
$("pg-stop-button").addEventListener("click", stop);
$("pg-regenerate").addEventListener("click", regenerate);
$("pg-clear").addEventListener("click", () => {
  stop();
  Play.messages = [];
  Play.completionPrompt = "";
  Play.view = null;
  renderTranscript();
});
$("pg-input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); send(); }
});
syncMode();
})();
