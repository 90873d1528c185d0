// The chat page: conversations (store.js) shown as messages, replies streamed from the server (chat.js)
// and rendered as markdown built from DOM nodes (markdown.js), the model and load in a corner (status.js).
// Each reply element carries data-state: streaming | done | stopped | error.

import { streamChat } from "./chat.js";
import { renderCode, renderMarkdown } from "./markdown.js";
import { loadModel, watchMetrics } from "./status.js";
import * as store from "./store.js";

const $ = (id) => document.getElementById(id);
const NUMBERS = { temperature: Number, top_p: Number, top_k: parseInt, min_p: Number, max_tokens: parseInt, seed: parseInt };
const SETTING_IDS = ["system", ...Object.keys(NUMBERS), "stop-strings", "schema"];

let conversations = store.loadConversations();
let current = null; // the conversation shown
let controller = null; // the running reply's AbortController
let model = null; // the served model's card, once /v1/models answered

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
  const area = el("textarea");
  area.value = text;
  document.body.appendChild(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

function copyButton(getText) {
  const button = el("button", "small copy", "Copy");
  button.type = "button";
  button.addEventListener("click", async () => {
    await copyText(getText());
    button.textContent = "Copied";
    setTimeout(() => (button.textContent = "Copy"), 1200);
  });
  return button;
}

// -- requests -----------------------------------------------------------------------------------------

/** The request body for the conversation so far, from the settings; throws on a schema that is not JSON. */
function requestBody(conv) {
  const body = model ? { model: model.id } : {};
  for (const [name, parse] of Object.entries(NUMBERS)) {
    const raw = $(name).value.trim();
    if (raw !== "") body[name] = parse(raw);
  }
  const stops = $("stop-strings").value.split("\n").filter((s) => s !== "");
  if (stops.length) body.stop = stops;
  const schemaText = $("schema").value.trim();
  $("schema-error").hidden = true;
  if (schemaText) {
    let schema;
    try {
      schema = JSON.parse(schemaText);
    } catch (e) {
      $("schema-error").textContent = `JSON schema: ${e.message}`;
      $("schema-error").hidden = false;
      throw e;
    }
    body.response_format = { type: "json_schema", json_schema: { name: "page_schema", schema } };
  }
  const system = $("system").value.trim();
  const history = conv.messages.filter((m) => m.role === "user" || m.content);
  body.messages = [...(system ? [{ role: "system", content: system }] : []),
    ...history.map((m) => ({ role: m.role, content: m.content }))];
  return body;
}

function statsLine(clock, usage, state) {
  const tokens = usage ? usage.completion_tokens : clock.pieces;
  const parts = [`${tokens} tokens`];
  if (clock.first !== null) {
    const decode = (clock.last - clock.first) / 1000;
    if (tokens > 1 && decode > 0) parts.push(`${((tokens - 1) / decode).toFixed(1)} tok/s`);
    parts.push(`TTFT ${Math.round(clock.first - clock.start)} ms`);
  }
  const cached = usage?.prompt_tokens_details?.cached_tokens;
  if (cached !== undefined) parts.push(`cached ${cached} of ${usage.prompt_tokens}`);
  if (state === "stopped") parts.push("stopped");
  return parts.join(" · ");
}

async function generate(conv) {
  let body;
  try {
    body = requestBody(conv);
  } catch {
    return;
  }
  const reply = { role: "assistant", content: "", state: "streaming", stats: "" };
  if (body.response_format) reply.format = "json"; // shown as a code block, not read as markdown
  conv.messages.push(reply);
  persist();
  const node = appendMessage(conv, conv.messages.length - 1);
  controller = new AbortController();
  setBusy(true);
  const clock = { start: performance.now(), first: null, last: null, pieces: 0 };
  let usage = null;
  try {
    await streamChat(body, $("api-key").value, controller.signal, {
      onDelta(text) {
        clock.last = performance.now();
        if (clock.first === null) clock.first = clock.last;
        clock.pieces += 1;
        reply.content += text;
        reply.stats = statsLine(clock, null, "streaming");
        fillMessage(node, reply);
      },
      onUsage: (u) => (usage = u),
    });
    reply.state = "done";
  } catch (e) {
    reply.state = e.name === "AbortError" ? "stopped" : "error";
    if (reply.state === "error") showError(e.message);
  }
  reply.stats = statsLine(clock, usage, reply.state);
  controller = null;
  setBusy(false);
  fillMessage(node, reply);
  persist();
}

function stop() {
  if (controller) controller.abort();
}

// -- rendering ------------------------------------------------------------------------------------------

function fillMessage(node, message) {
  const content = node.querySelector(".content");
  if (message.role === "user") content.textContent = message.content;
  else if (message.format === "json") content.replaceChildren(renderCode("json", message.content, copyButton));
  else content.replaceChildren(renderMarkdown(message.content, copyButton));
  node.querySelector(".stats").textContent = message.stats || "";
  node.dataset.state = message.state || "done";
}

function appendMessage(conv, index) {
  const message = conv.messages[index];
  const node = el("div", `msg ${message.role}`);
  const head = el("div", "role", message.role === "user" ? "you" : "assistant");
  const tools = el("span", "tools");
  if (message.role === "user") {
    const edit = el("button", "small edit", "Edit");
    edit.type = "button";
    edit.addEventListener("click", () => startEdit(conv, index, node));
    tools.appendChild(edit);
  }
  tools.appendChild(copyButton(() => message.content));
  head.appendChild(tools);
  node.append(head, el("div", "content"), el("div", "stats"));
  fillMessage(node, message);
  $("messages").appendChild(node);
  node.scrollIntoView({ block: "end" });
  return node;
}

/** Edit an earlier message in place; sending it drops what followed and asks again. */
function startEdit(conv, index, node) {
  if (controller) return;
  const area = el("textarea");
  area.value = conv.messages[index].content;
  area.rows = 3;
  const send = el("button", "small", "Send");
  const cancel = el("button", "small", "Cancel");
  send.type = cancel.type = "button";
  node.querySelector(".content").replaceChildren(area, send, cancel);
  area.focus();
  cancel.addEventListener("click", () => showConversation(conv));
  send.addEventListener("click", () => {
    conv.messages.splice(index);
    conv.messages.push({ role: "user", content: area.value });
    showConversation(conv);
    generate(conv);
  });
}

function showConversation(conv) {
  current = conv;
  store.saveCurrent(conv.id);
  $("messages").replaceChildren();
  conv.messages.forEach((_, i) => appendMessage(conv, i));
  renderList();
}

function renderList() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conv of conversations) {
    const item = el("li", conv === current ? "current" : "");
    item.appendChild(el("span", "", conv.title || "New conversation"));
    const remove = el("button", "small", "×");
    remove.title = "Delete";
    remove.addEventListener("click", (e) => {
      e.stopPropagation();
      deleteConversation(conv);
    });
    item.appendChild(remove);
    item.addEventListener("click", () => {
      if (!controller) showConversation(conv);
    });
    list.appendChild(item);
  }
}

function persist() {
  if (current && !current.title) {
    const first = current.messages.find((m) => m.role === "user");
    if (first) current.title = first.content.slice(0, 48);
  }
  store.saveConversations(conversations);
  renderList();
}

function newChat() {
  if (controller) return;
  if (current && current.messages.length === 0) return $("prompt").focus();
  const conv = store.newConversation();
  conversations.unshift(conv);
  persist();
  showConversation(conv);
  $("prompt").focus();
}

function deleteConversation(conv) {
  if (controller && conv === current) return;
  conversations = conversations.filter((c) => c !== conv);
  store.saveConversations(conversations);
  if (conv === current) {
    current = null;
    newChat();
  } else renderList();
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

// -- wiring ------------------------------------------------------------------------------------------------

function send() {
  const text = $("prompt").value;
  if (controller || text.trim() === "") return;
  showError("");
  $("prompt").value = "";
  current.messages.push({ role: "user", content: text });
  persist();
  appendMessage(current, current.messages.length - 1);
  generate(current);
}

function wireSettings() {
  const saved = store.loadSettings();
  for (const id of SETTING_IDS) {
    if (saved[id] !== undefined) $(id).value = saved[id];
    $(id).addEventListener("input", () => {
      store.saveSettings(Object.fromEntries(SETTING_IDS.map((i) => [i, $(i).value])));
    });
  }
  $("toggle-settings").addEventListener("click", () => ($("settings").hidden = !$("settings").hidden));
  $("toggle-side").addEventListener("click", () => $("side").classList.toggle("closed"));
  // On a phone the conversation list folds away, and folds again once one is picked.
  const phone = window.matchMedia("(max-width: 700px)");
  $("side").classList.toggle("closed", phone.matches);
  phone.addEventListener("change", (e) => $("side").classList.toggle("closed", e.matches));
  $("conversations").addEventListener("click", () => phone.matches && $("side").classList.add("closed"));
  $("new-chat").addEventListener("click", () => phone.matches && $("side").classList.add("closed"));
}

function start() {
  for (const conv of conversations) {
    for (const m of conv.messages) if (m.state === "streaming") m.state = "stopped"; // the page closed mid-reply
  }
  wireSettings();
  $("api-key").value = store.loadKey();
  $("api-key").addEventListener("change", async () => {
    store.saveKey($("api-key").value);
    model = await loadModel($("api-key").value, (t) => ($("model").textContent = t));
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape") stop();
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  const saved = conversations.find((c) => c.id === store.loadCurrent());
  if (saved) showConversation(saved);
  else newChat();
  loadModel($("api-key").value, (t) => ($("model").textContent = t)).then((card) => (model = card));
  watchMetrics((t) => ($("metrics").textContent = t));
}

start();
