"use strict";
// The supervisor's page (docs/web.md): a chat over /v1/chat/completions and a view of the runners over
// /mlxserve/status, Ollama's /api/generate (load, unload) and /api/pull. Plain script, no build step; every
// request goes to this origin. A model's text reaches the document only through render(): Markdown to HTML
// (marked), then DOMPurify, as a DOM fragment.

const TOKEN_KEY = "mlxserve.token";
const CONVERSATIONS_KEY = "mlxserve.conversations";
const SETTINGS_KEY = "mlxserve.settings";
const HISTORY_SECONDS = 120;

const $ = (id) => document.getElementById(id);
const state = {
  token: localStorage.getItem(TOKEN_KEY) || "",
  conversations: [],
  current: null,
  controller: null,
  attachment: null, // a data: URL
  status: null,
  previous: null, // the status before, for rates
  history: {}, // model -> [[time, rss, mlx_active]]
  view: "chat",
  timer: null,
};

class Unauthorized extends Error {}

// -- requests ---------------------------------------------------------------------------------------------------

async function api(path, options = {}) {
  const headers = {...(options.headers || {})};
  if (state.token) headers.Authorization = `Bearer ${state.token}`;
  if (options.body && !headers["Content-Type"]) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {...options, headers, credentials: "omit", cache: "no-store"});
  if (response.status === 401) {
    lock(state.token ? "That token was refused." : "");
    throw new Unauthorized("token needed");
  }
  return response;
}

// A streamed answer's pieces as they come, split at ``separator`` ("\n\n": server-sent events, "\n": JSON lines):
// one array per read of the body, the unfinished rest kept for the next.
async function* streamPieces(response, separator) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    const pieces = buffer.split(separator);
    buffer = pieces.pop();
    yield pieces;
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    const error = body.error;
    return typeof error === "string" ? error : (error && error.message) || JSON.stringify(body);
  } catch (e) {
    return `${response.status} ${response.statusText}`;
  }
}

// -- the token ----------------------------------------------------------------------------------------------------

function lock(message) {
  $("main").hidden = true;
  $("tabs").hidden = true;
  $("forget-token").hidden = true;
  $("locked").hidden = false;
  stopPolling();
  const error = $("token-error");
  error.hidden = !message;
  error.textContent = message || "";
  if (!$("token-dialog").open) $("token-dialog").showModal();
  $("token-input").focus();
}

function unlock() {
  if ($("token-dialog").open) $("token-dialog").close();
  $("locked").hidden = true;
  $("main").hidden = false;
  $("tabs").hidden = false;
  $("forget-token").hidden = !state.token;
}

async function start() {
  try {
    await refreshStatus();
  } catch (error) {
    if (error instanceof Unauthorized) return;
    $("server").textContent = `status: ${error.message}`;
  }
  loadConversations();
  await refreshModels();
  unlock(); // once the models are listed: a message sent at once has its model
  showView(location.hash === "#runners" ? "runners" : "chat");
  startPolling(); // always: the runners' charts have their history when the view opens
}

$("token-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  state.token = $("token-input").value.trim();
  localStorage.setItem(TOKEN_KEY, state.token);
  $("token-input").value = "";
  await start();
});

$("token-dialog").addEventListener("cancel", (event) => event.preventDefault()); // Escape does not dismiss it

$("forget-token").addEventListener("click", () => {
  localStorage.removeItem(TOKEN_KEY);
  state.token = "";
  lock("");
});

// -- views --------------------------------------------------------------------------------------------------------

function showView(view) {
  state.view = view;
  for (const tab of document.querySelectorAll(".tab")) tab.setAttribute("aria-selected", String(tab.dataset.view === view));
  $("chat-view").hidden = view !== "chat";
  $("runners-view").hidden = view !== "runners";
  history.replaceState(null, "", view === "runners" ? "#runners" : "#");
  if (view === "runners" && state.status) drawRunners();
}

for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => showView(tab.dataset.view));

// -- Markdown, safely -------------------------------------------------------------------------------------------

const FORBID_TAGS = ["style", "img", "video", "audio", "source", "picture", "iframe", "object", "embed", "form",
  "input", "button", "textarea", "select", "link", "meta", "base", "svg", "math"];

if (window.DOMPurify) {
  // Links from a model open elsewhere, without this page as opener or referrer.
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });
}

// A model's (or a stored conversation's) Markdown as a sanitised DOM fragment: no script, no event handler, no
// style, no image or frame (which would load from elsewhere), whatever the text holds.
function render(markdown) {
  const html = marked.parse(String(markdown || ""), {gfm: true, breaks: false, async: false});
  return DOMPurify.sanitize(html, {
    RETURN_DOM_FRAGMENT: true,
    FORBID_TAGS,
    FORBID_ATTR: ["style", "srcset", "action", "formaction"],
    ALLOW_DATA_ATTR: false,
  });
}

// -- conversations ------------------------------------------------------------------------------------------------

function loadConversations() {
  try {
    state.conversations = JSON.parse(localStorage.getItem(CONVERSATIONS_KEY) || "[]");
    if (!Array.isArray(state.conversations)) state.conversations = [];
  } catch (e) {
    state.conversations = [];
  }
  let settings = {};
  try {
    settings = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") || {};
  } catch (e) { /* none kept */ }
  $("temperature").value = settings.temperature ?? "";
  $("top-p").value = settings.top_p ?? "";
  $("max-tokens").value = settings.max_tokens ?? "";
  $("seed").value = settings.seed ?? "";
  $("tools").value = settings.tools ?? "";
  $("model").value = settings.model || "";
  state.current = state.conversations[0] || newConversation();
  showConversation();
}

function saveConversations() {
  const keep = state.conversations.filter((c) => c.messages.length).slice(0, 50);
  try {
    localStorage.setItem(CONVERSATIONS_KEY, JSON.stringify(keep));
  } catch (e) {
    // Over the browser's quota (images): keep the text, drop the pictures.
    const lighter = keep.map((c) => ({...c, messages: c.messages.map((m) => ({...m, image: m.image ? "" : undefined}))}));
    try {
      localStorage.setItem(CONVERSATIONS_KEY, JSON.stringify(lighter));
    } catch (e2) { /* nothing more to do */ }
  }
}

function saveSettings() {
  const settings = {
    model: $("model").value.trim(),
    temperature: $("temperature").value,
    top_p: $("top-p").value,
    max_tokens: $("max-tokens").value,
    seed: $("seed").value,
    tools: $("tools").value,
  };
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
}

for (const id of ["model", "temperature", "top-p", "max-tokens", "seed", "tools"]) $(id).addEventListener("change", saveSettings);
$("system").addEventListener("change", () => {
  state.current.system = $("system").value;
  saveConversations();
});

function newConversation() {
  const conversation = {id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`, title: "New chat",
    system: "", messages: [], updated: Date.now()};
  state.conversations.unshift(conversation);
  return conversation;
}

$("new-chat").addEventListener("click", () => {
  if (state.controller) return;
  state.current = state.current.messages.length ? newConversation() : state.current;
  showConversation();
});

function showConversation() {
  $("system").value = state.current.system || "";
  const list = $("conversation-list");
  list.replaceChildren();
  for (const conversation of state.conversations) {
    if (!conversation.messages.length && conversation !== state.current) continue;
    const item = document.createElement("li");
    const open = document.createElement("button");
    open.type = "button";
    open.className = "conversation" + (conversation === state.current ? " current" : "");
    open.textContent = conversation.title || "Chat";
    open.addEventListener("click", () => {
      if (state.controller) return;
      state.current = conversation;
      showConversation();
    });
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "quiet remove";
    remove.textContent = "×";
    remove.title = "Delete this conversation";
    remove.addEventListener("click", () => {
      if (state.controller) return;
      state.conversations = state.conversations.filter((c) => c !== conversation);
      if (state.current === conversation) state.current = state.conversations[0] || newConversation();
      saveConversations();
      showConversation();
    });
    item.append(open, remove);
    list.append(item);
  }
  const messages = $("messages");
  messages.replaceChildren();
  for (const message of state.current.messages) messages.append(messageElement(message));
  messages.scrollTop = messages.scrollHeight;
}

// -- messages -----------------------------------------------------------------------------------------------------

function messageElement(message) {
  const box = document.createElement("article");
  box.className = `message ${message.role}`;
  fillMessage(box, message);
  return box;
}

function fillMessage(box, message) {
  const parts = [];
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = message.role === "user" ? "You" : message.model || "Assistant";
  parts.push(who);
  if (message.image) {
    const image = document.createElement("img");
    image.className = "attached";
    image.alt = "attached image";
    if (message.image.startsWith("data:image/")) image.src = message.image;
    parts.push(image);
  }
  if (message.reasoning) {
    const details = document.createElement("details");
    details.className = "reasoning";
    const summary = document.createElement("summary");
    summary.textContent = message.content || message.tool_calls ? "Reasoning" : "Reasoning…";
    const body = document.createElement("div");
    body.className = "reasoning-text";
    body.textContent = message.reasoning;
    details.append(summary, body);
    parts.push(details);
  }
  const content = document.createElement("div");
  content.className = "content";
  if (message.role === "assistant") content.append(render(message.content));
  else content.textContent = message.content || "";
  parts.push(content);
  for (const call of message.tool_calls || []) {
    const tool = document.createElement("div");
    tool.className = "tool-call";
    const name = document.createElement("span");
    name.className = "tool-name";
    name.textContent = `tool call: ${call.function?.name || "?"}`;
    const args = document.createElement("pre");
    args.textContent = call.function?.arguments || "";
    tool.append(name, args);
    parts.push(tool);
  }
  if (message.error) {
    const error = document.createElement("div");
    error.className = "error";
    error.textContent = message.error;
    parts.push(error);
  }
  if (message.figures) parts.push(figuresElement(message.figures));
  box.replaceChildren(...parts);
}

// Under an answer: its speed, time to first token, speculation and prompt cache, as the API reported them.
function figuresElement(f) {
  const line = document.createElement("div");
  line.className = "figures";
  const items = [];
  if (f.tokens_per_second) items.push(["tok/s", f.tokens_per_second.toFixed(1)]);
  if (f.time_to_first_token_s) items.push(["first token", `${Math.round(f.time_to_first_token_s * 1000)} ms`]);
  if (f.completion_tokens !== undefined) items.push(["tokens", String(f.completion_tokens)]);
  if (f.drafted) items.push(["drafted / accepted", `${f.drafted} / ${f.accepted} (${f.drafter || "draft"})`]);
  if (f.prompt_tokens !== undefined) items.push(["cached prompt", `${f.cached_tokens || 0} / ${f.prompt_tokens}`]);
  if (f.finish_reason) items.push(["finish", f.finish_reason]);
  for (const [name, value] of items) {
    const item = document.createElement("span");
    item.dataset.figure = name;
    item.textContent = `${name}: ${value}`;
    line.append(item);
  }
  return line;
}

// -- sending --------------------------------------------------------------------------------------------------

function number(id, integer) {
  const text = $(id).value.trim();
  if (text === "") return undefined;
  const value = integer ? parseInt(text, 10) : parseFloat(text);
  return Number.isFinite(value) ? value : undefined;
}

function apiMessages(conversation) {
  const out = [];
  if (conversation.system) out.push({role: "system", content: conversation.system});
  for (const m of conversation.messages) {
    if (m.role === "assistant") {
      if (m.error && !m.content && !m.tool_calls) continue;
      // The page runs no tool: an earlier call goes back as text, so the history needs no tool results.
      const calls = (m.tool_calls || []).map((c) => `[called ${c.function?.name}(${c.function?.arguments})]`);
      out.push({role: "assistant", content: [m.content || "", ...calls].filter(Boolean).join("\n")});
    } else if (m.image) {
      out.push({role: "user", content: [{type: "text", text: m.content || ""}, {type: "image_url", image_url: {url: m.image}}]});
    } else {
      out.push({role: m.role, content: m.content || ""});
    }
  }
  return out;
}

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});

$("stop").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
});

$("image").addEventListener("change", () => {
  const file = $("image").files[0];
  if (!file) return;
  const reader = new FileReader();
  reader.addEventListener("load", () => {
    state.attachment = String(reader.result);
    $("attachment-preview").src = state.attachment;
    $("attachment").hidden = false;
  });
  reader.readAsDataURL(file);
});

$("attachment-remove").addEventListener("click", clearAttachment);

function clearAttachment() {
  state.attachment = null;
  $("image").value = "";
  $("attachment-preview").removeAttribute("src");
  $("attachment").hidden = true;
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("prompt").disabled = on;
}

async function send() {
  const text = $("prompt").value.trim();
  const model = $("model").value.trim();
  if (state.controller || (!text && !state.attachment)) return;
  if (!model) {
    $("model-note").textContent = "Pick a model first.";
    $("model").focus();
    return;
  }
  saveSettings();
  const conversation = state.current;
  conversation.system = $("system").value;
  const user = {role: "user", content: text};
  if (state.attachment) user.image = state.attachment;
  conversation.messages.push(user);
  if (conversation.title === "New chat") conversation.title = (text || "image").slice(0, 48);
  conversation.updated = Date.now();
  const body = {model, messages: apiMessages(conversation), stream: true, stream_options: {include_usage: true}};
  const temperature = number("temperature"), topP = number("top-p");
  const maxTokens = number("max-tokens", true), seed = number("seed", true);
  if (temperature !== undefined) body.temperature = temperature;
  if (topP !== undefined) body.top_p = topP;
  if (maxTokens !== undefined) body.max_tokens = maxTokens;
  if (seed !== undefined) body.seed = seed;
  const tools = $("tools").value.trim();
  if (tools) {
    try {
      body.tools = JSON.parse(tools);
    } catch (e) {
      $("model-note").textContent = `Tools: not JSON (${e.message})`;
      conversation.messages.pop();
      return;
    }
  }
  $("prompt").value = "";
  clearAttachment();
  const answer = {role: "assistant", model, content: "", reasoning: "", tool_calls: []};
  conversation.messages.push(answer);
  saveConversations();
  showConversation();
  const box = $("messages").lastElementChild;
  box.classList.add("streaming");
  state.controller = new AbortController();
  busy(true);
  const figures = {};
  try {
    const response = await api("/v1/chat/completions", {method: "POST", body: JSON.stringify(body),
      signal: state.controller.signal});
    if (!response.ok) throw new Error(await errorText(response));
    for await (const events of streamPieces(response, "\n\n")) {
      for (const event of events) {
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          take(JSON.parse(data), answer, figures);
        }
      }
      fillMessage(box, answer);
      $("messages").scrollTop = $("messages").scrollHeight;
    }
  } catch (error) {
    if (error.name === "AbortError") answer.error = "stopped";
    else if (!(error instanceof Unauthorized)) answer.error = error.message;
    else answer.error = "token needed";
  } finally {
    state.controller = null;
    busy(false);
    if (!answer.tool_calls.length) delete answer.tool_calls;
    if (!answer.reasoning) delete answer.reasoning;
    if (Object.keys(figures).length) answer.figures = figures;
    box.classList.remove("streaming");
    fillMessage(box, answer);
    saveConversations();
    $("prompt").focus();
  }
}

// One streamed event of OpenAI's chat completion (with mlxserve's x_mlxserve figures) into the answer.
function take(event, answer, figures) {
  if (event.error) throw new Error(event.error.message || JSON.stringify(event.error));
  for (const choice of event.choices || []) {
    const delta = choice.delta || {};
    if (delta.content) answer.content += delta.content;
    if (delta.reasoning_content) answer.reasoning += delta.reasoning_content;
    for (const piece of delta.tool_calls || []) {
      const call = answer.tool_calls[piece.index] ||= {id: "", type: "function", function: {name: "", arguments: ""}};
      if (piece.id) call.id = piece.id;
      if (piece.function?.name) call.function.name = piece.function.name;
      if (piece.function?.arguments) call.function.arguments += piece.function.arguments;
    }
    if (choice.finish_reason) figures.finish_reason = choice.finish_reason;
  }
  if (event.x_mlxserve) Object.assign(figures, event.x_mlxserve);
  if (event.usage) {
    figures.prompt_tokens = event.usage.prompt_tokens;
    figures.completion_tokens = event.usage.completion_tokens;
    figures.cached_tokens = event.usage.prompt_tokens_details?.cached_tokens || 0;
  }
}

// -- models ---------------------------------------------------------------------------------------------------------

async function refreshModels() {
  let listed = [];
  try {
    const response = await api("/v1/models");
    if (response.ok) listed = (await response.json()).data.map((m) => m.id);
  } catch (error) {
    if (error instanceof Unauthorized) return;
  }
  const configured = new Set((state.status?.models || []).map((m) => m.name));
  const list = $("model-list");
  list.replaceChildren();
  for (const name of listed) {
    const option = document.createElement("option");
    option.value = name;
    option.label = configured.has(name) ? "configured" : name.includes(":") && configured.has(name.split(":")[0])
      ? "adapter" : "in the hub cache";
    list.append(option);
  }
  if (!$("model").value && listed.length) $("model").value = listed[0];
  const pull = state.status?.pull;
  $("model-note").textContent = pull === "any"
    ? "Any Hugging Face hub repository may be named: it is pulled on the first request."
    : pull === "cached" ? "Configured models, and hub repositories already in the hub cache." : "Configured models.";
}

// -- runners -------------------------------------------------------------------------------------------------------

function bytes(value) {
  if (!value) return "0";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (value >= 1024 && i < units.length - 1) {
    value /= 1024;
    i++;
  }
  return `${value >= 100 || i === 0 ? value.toFixed(0) : value.toFixed(1)} ${units[i]}`;
}

function duration(seconds) {
  if (!seconds) return "-";
  if (seconds < 60) return `${seconds.toFixed(0)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${Math.floor(seconds % 60)} s`;
  return `${Math.floor(seconds / 3600)} h ${Math.floor((seconds % 3600) / 60)} min`;
}

async function refreshStatus() {
  const response = await api("/mlxserve/status");
  if (!response.ok) throw new Error(await errorText(response));
  const status = await response.json();
  state.previous = state.status;
  state.status = status;
  $("server").textContent = `supervisor ${status.version} · pid ${status.pid} · up ${duration(status.uptime_s)}`;
  for (const model of status.models) {
    const points = (state.history[model.name] ||= []);
    if (model.pid) points.push([status.time, model.memory.rss, model.memory.mlx_active]);
    while (points.length && status.time - points[0][0] > HISTORY_SECONDS) points.shift();
  }
  return status;
}

function startPolling() {
  if (state.timer) return;
  const tick = async () => {
    try {
      await refreshStatus();
      if (state.view === "runners") drawRunners();
    } catch (error) {
      if (error instanceof Unauthorized) return;
      $("supervisor-line").textContent = `status: ${error.message}`;
    }
    if (state.timer) state.timer = setTimeout(tick, 1000);
  };
  state.timer = setTimeout(tick, 0);
}

function stopPolling() {
  clearTimeout(state.timer);
  state.timer = null;
}

function row(table, name, value) {
  const tr = document.createElement("tr");
  const th = document.createElement("th");
  th.textContent = name;
  const td = document.createElement("td");
  td.textContent = value;
  td.dataset.field = name;
  tr.append(th, td);
  table.append(tr);
}

function rate(model) {
  const before = state.previous?.models.find((m) => m.name === model.name);
  if (!before || !state.previous) return 0;
  const seconds = state.status.time - state.previous.time;
  return seconds > 0 ? Math.max(0, model.generated_tokens - before.generated_tokens) / seconds : 0;
}

function drawRunners() {
  const status = state.status;
  const box = $("runners");
  const cards = [];
  for (const model of status.models) {
    const card = document.createElement("article");
    card.className = "runner";
    card.dataset.model = model.name;
    const title = document.createElement("h3");
    const state_ = model.state.replace("RUNNER_STATE_", "").toLowerCase();
    const badge = document.createElement("span");
    badge.className = `badge ${state_}`;
    badge.textContent = state_;
    title.append(`${model.name} `, badge);
    const memory = model.memory;
    const chart = MlxChart.lineChart(
      [
        {label: "RSS", cls: "rss", points: (state.history[model.name] || []).map(([t, rss]) => [t, rss])},
        {label: "MLX active", cls: "mlx", points: (state.history[model.name] || []).map(([t, , mlx]) => [t, mlx])},
      ],
      [{label: "soft", cls: "soft", value: memory.soft_limit}, {label: "hard", cls: "hard", value: memory.hard_limit}],
      {now: status.time, span: HISTORY_SECONDS, format: bytes, label: `${model.name}: RSS against its limits`},
    );
    const legend = document.createElement("div");
    legend.className = "legend";
    for (const [cls, text] of [["rss", "RSS"], ["mlx", "MLX active"], ["soft", "soft limit"], ["hard", "hard limit"]]) {
      const key = document.createElement("span");
      key.className = `key ${cls}`;
      key.textContent = text;
      legend.append(key);
    }
    const table = document.createElement("table");
    const cache = memory.prompt_cache;
    const lookups = cache.hits + cache.misses;
    row(table, "pid", model.pid ? String(model.pid) : "-");
    row(table, "uptime", model.pid ? duration(model.uptime_s) : "-");
    row(table, "restarts", String(model.restarts));
    row(table, "state reason", model.reason || "-");
    row(table, "last failure", model.last_failure
      ? `${model.last_failure} (${duration(model.last_failure_s_ago)} ago)` : "none");
    row(table, "RSS", `${bytes(memory.rss)} (anonymous ${bytes(memory.anonymous)}, peak ${bytes(memory.peak_rss)})`);
    row(table, "limits", `soft ${memory.soft_limit ? bytes(memory.soft_limit) : "none"}, hard ${
      memory.hard_limit ? bytes(memory.hard_limit) : "none"}, estimate ${bytes(memory.estimate)}`);
    row(table, "MLX", `active ${bytes(memory.mlx_active)}, pool ${bytes(memory.mlx_cache)}, peak ${bytes(memory.mlx_peak)}`);
    row(table, "requests", `${memory.active_requests} active, ${memory.queued} queued, ${model.in_flight} in flight`);
    row(table, "tok/s", rate(model).toFixed(1));
    row(table, "acceptance", model.acceptance_rate ? `${(model.acceptance_rate * 100).toFixed(0)}%` : "-");
    row(table, "prompt cache", cache.budget
      ? `${bytes(cache.bytes)} of ${bytes(cache.budget)}, ${cache.entries} entries, hit rate ${
        lookups ? `${((100 * cache.hits) / lookups).toFixed(0)}%` : "-"} (${cache.hits}/${lookups})`
      : "off");
    const buttons = document.createElement("div");
    buttons.className = "buttons";
    const load = document.createElement("button");
    load.type = "button";
    load.textContent = "Load";
    load.className = "load";
    load.disabled = state_ === "serving" || state_ === "starting";
    load.addEventListener("click", () => loadOrUnload(model.name, true, load));
    const unload = document.createElement("button");
    unload.type = "button";
    unload.textContent = "Unload";
    unload.className = "unload";
    unload.disabled = !model.pid;
    unload.addEventListener("click", () => loadOrUnload(model.name, false, unload));
    buttons.append(load, unload);
    card.append(title, chart, legend, table, buttons);
    cards.push(card);
  }
  box.replaceChildren(...cards);
  const pulls = $("pulls");
  pulls.replaceChildren(...status.pulls.map((p) => progressElement(p.model, p.status, p.completed, p.total)));
  $("supervisor-line").textContent = `${status.models.length} models, at most ${status.max_loaded || "all"} loaded; ${
    status.cached.length} in the hub cache; pulls: ${status.pull}`;
  $("pull-note").textContent = status.pull === "any" ? "" : `pulls are off here (pull = "${status.pull}")`;
}

async function loadOrUnload(name, load, button) {
  button.disabled = true;
  const body = load ? {model: name} : {model: name, keep_alive: 0};
  try {
    const response = await api("/api/generate", {method: "POST", body: JSON.stringify(body)});
    if (!response.ok) $("supervisor-line").textContent = `${name}: ${await errorText(response)}`;
  } catch (error) {
    if (!(error instanceof Unauthorized)) $("supervisor-line").textContent = `${name}: ${error.message}`;
  }
}

function progressElement(model, text, completed, total) {
  const box = document.createElement("div");
  box.className = "pull";
  const label = document.createElement("span");
  label.textContent = `${model}: ${text}${total ? ` (${bytes(completed)} of ${bytes(total)})` : ""}`;
  const bar = document.createElement("progress");
  bar.max = total || 1;
  bar.value = total ? completed : 0;
  box.append(label, bar);
  return box;
}

$("pull-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const model = $("pull-model").value.trim();
  if (!model) return;
  const mine = $("pull-progress") || document.createElement("div");
  mine.id = "pull-progress";
  $("pull-form").after(mine);
  const files = {};
  const show = (text) => {
    let completed = 0, total = 0;
    for (const f of Object.values(files)) {
      completed += f.completed;
      total += f.total;
    }
    mine.replaceChildren(progressElement(model, text, completed, total));
  };
  show("starting");
  try {
    const response = await api("/api/pull", {method: "POST", body: JSON.stringify({model, stream: true})});
    if (!response.ok) throw new Error(await errorText(response));
    for await (const lines of streamPieces(response, "\n")) {
      for (const piece of lines) {
        const line = piece.trim();
        if (!line) continue;
        const record = JSON.parse(line);
        if (record.error) throw new Error(record.error);
        if (record.digest) files[record.digest] = {completed: record.completed || 0, total: record.total || 0};
        show(record.status);
      }
    }
    refreshModels();
  } catch (error) {
    if (!(error instanceof Unauthorized)) show(`failed: ${error.message}`);
  }
});

start();
