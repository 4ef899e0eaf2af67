// pagoda console: what every tab shares — the API key (kept in this browser only), authenticated fetches,
// an SSE reader over fetch (EventSource cannot send an Authorization header), tabs, and number formats.
"use strict";

const PG = {
  key: localStorage.getItem("pagoda.apiKey") || "",
  info: null,
  tab: "playground",
  onTab: [],  // callbacks (name) when the visible tab changes
};
window.pagodaConsole = PG;  // for tests and the curious

class AuthError extends Error {}

PG.$ = (id) => document.getElementById(id);

PG.headers = function (extra) {
  const headers = Object.assign({}, extra || {});
  if (PG.key) headers["Authorization"] = "Bearer " + PG.key;
  return headers;
};

// fetch with the key; a 401 opens the key dialog and throws AuthError
PG.fetch = async function (path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = PG.headers(opts.headers);
  const response = await fetch(path, opts);
  if (response.status === 401) {
    PG.askKey(PG.key ? "The server refused this key." : "");
    throw new AuthError("unauthorized");
  }
  return response;
};

PG.json = async function (path) {
  const response = await PG.fetch(path);
  if (!response.ok) throw new Error(await PG.errorText(response));
  return response.json();
};

PG.errorText = async function (response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return `HTTP ${response.status}: ${body.error.message}`;
  } catch (e) { /* not JSON */ }
  return `HTTP ${response.status}: ${text.slice(0, 300)}`;
};

// Reads an SSE body, calling onEvent(name, data) per event ("message" when unnamed); resolves at the end.
PG.readSSE = async function (response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(name, data.join("\n"));
    }
  }
};

// ---------------------------------------------------------------- key dialog

PG.askKey = function (message) {
  PG.$("key-error").textContent = message || "";
  PG.$("key-input").value = "";
  PG.$("key-dialog").hidden = false;
  PG.$("key-input").focus();
};

PG.$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  PG.key = PG.$("key-input").value.trim();
  localStorage.setItem("pagoda.apiKey", PG.key);
  PG.$("key-dialog").hidden = true;
  PG.boot();
});
PG.$("key-forget").addEventListener("click", () => {
  PG.key = "";
  localStorage.removeItem("pagoda.apiKey");
  PG.$("key-input").value = "";
  PG.$("key-error").textContent = "Forgotten.";
});
PG.$("key-button").addEventListener("click", () => PG.askKey(""));

// ---------------------------------------------------------------- tabs

PG.showTab = function (name) {
  PG.tab = name;
  for (const button of document.querySelectorAll(".tab")) button.classList.toggle("active", button.dataset.tab === name);
  for (const page of document.querySelectorAll(".tab-page")) page.hidden = page.id !== "tab-" + name;
  for (const callback of PG.onTab) callback(name);
};
for (const button of document.querySelectorAll(".tab")) button.addEventListener("click", () => PG.showTab(button.dataset.tab));

// ---------------------------------------------------------------- formats

PG.num = function (value, digits) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  const d = digits === undefined ? (Math.abs(value) >= 100 ? 0 : 1) : digits;
  return Number(value).toLocaleString("en-US", { minimumFractionDigits: d, maximumFractionDigits: d });
};
PG.ms = function (value) {
  if (value === null || value === undefined) return "–";
  return value >= 1000 ? PG.num(value / 1000, 2) + " s" : PG.num(value, value >= 100 ? 0 : 1) + " ms";
};
PG.pct = function (value) {
  return value === null || value === undefined ? "–" : PG.num(100 * value, 1) + "%";
};
PG.setState = function (element, state, text) {
  element.className = "pill state-" + state;
  element.textContent = text || state;
};
PG.el = function (tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child);
  return node;
};

// ---------------------------------------------------------------- start

PG.boot = async function () {
  try {
    PG.info = await PG.json("/console/api/info");
  } catch (error) {
    if (!(error instanceof AuthError)) PG.setState(PG.$("health"), "unavailable", "unreachable");
    return;
  }
  PG.$("model-name").textContent = PG.info.model + (PG.info.max_model_len ? ` · ${PG.info.max_model_len} ctx` : "");
  for (const callback of PG.onBoot) callback();
};
PG.onBoot = [];
window.addEventListener("load", () => PG.boot());
