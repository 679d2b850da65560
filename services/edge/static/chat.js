// The chat page's script: a file of its own, so the page's CSP needs no 'unsafe-inline'.
"use strict";
const log = document.getElementById("log");
const statusLine = document.getElementById("status");
const sendButton = document.getElementById("send");
const stopButton = document.getElementById("stop");
// Every finished turn, {role, content}; each request carries all of them (`messages`).
const conversation = [];
const byClient = new Map();   // client_id -> answer
const byRequest = new Map();  // request_id -> answer
let counter = 0;
let current = null;           // the answer streaming now, if any
let ws = null;
let retryMs = 250;

// The API key comes in the link's fragment (#key=...), which browsers send to no server.
// It is kept for this tab only and taken out of the address bar. A link with another key
// than the one this tab holds replaces it only if the user says so: a link someone sent
// could otherwise make the page talk as their tenant (issue 37).
const fragment = new URLSearchParams(location.hash.slice(1));
if (fragment.has("key")) {
  const linked = fragment.get("key");
  const held = sessionStorage.getItem("tokenbus-key");
  if (!held || held === linked ||
      confirm("This link carries another API key than the one this tab uses. " +
              "Use the link's key? (Cancel keeps the current one.)")) {
    sessionStorage.setItem("tokenbus-key", linked);
  }
  history.replaceState(null, "", location.pathname + location.search);
}
const apiKey = sessionStorage.getItem("tokenbus-key");
const url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/v1/chat";

// An answer's Markdown as HTML, cut down to what Markdown needs: model output is untrusted
// (a prompt injection can make it anything), and nothing reaches innerHTML without DOMPurify.
// An allowlist, not DOMPurify's default: no <img> (a beacon that leaks the conversation), no
// <form>/<input> (a prompt for the key), no <style> or style attribute (an overlay), links to
// http(s) and mailto only, opened without a referrer. The page's CSP (services/edge/page.py)
// is the second wall behind this one.
const ANSWER_HTML = {
  ALLOWED_TAGS: [
    "p", "br", "strong", "em", "code", "pre", "ul", "ol", "li", "blockquote",
    "h1", "h2", "h3", "h4", "h5", "h6", "a", "hr", "del",
    "table", "thead", "tbody", "tr", "th", "td",
  ],
  ALLOWED_ATTR: ["href", "rel", "target", "class", "start"],
  ALLOWED_URI_REGEXP: /^(?:https?|mailto):/i,
  ALLOW_DATA_ATTR: false,
  ALLOW_ARIA_ATTR: false,
};
// `class` only as marked writes it on a code block (`language-python`): no page class
// (`error`, `meta`) lent to an answer to pass for the page's own lines.
DOMPurify.addHook("uponSanitizeAttribute", (node, data) => {
  if (data.attrName === "class") {
    data.keepAttr = node.nodeName === "CODE" && /^language-[\w+#-]{1,32}$/.test(data.attrValue);
  }
});
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.nodeName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer nofollow");
  }
});
function renderMarkdown(text) {
  return DOMPurify.sanitize(marked.parse(text, {gfm: true, breaks: false}), ANSWER_HTML);
}

function line(cls, text) {
  const el = document.createElement("div");
  el.className = cls; el.textContent = text; log.appendChild(el);
  log.scrollTop = log.scrollHeight; return el;
}

function send(frame) {
  if (ws && ws.readyState === WebSocket.OPEN) { ws.send(JSON.stringify(frame)); return true; }
  return false;  // sent (or resumed) when the socket is back
}

// A socket that drops is replaced; its streams are resumed where the page left them, so
// each delta shows once: `seq` counts within an attempt, `chat.reset` starts a new attempt.
function connect() {
  ws = new WebSocket(url);
  ws.onopen = () => {
    if (!apiKey) {
      statusLine.textContent = "no API key: open the link `tokenbus up` printed (…/#key=…)";
      return;
    }
    ws.send(JSON.stringify({type: "auth", api_key: apiKey}));
    statusLine.textContent = "connected to " + url;
    retryMs = 250;
    for (const a of byClient.values()) {
      if (!a.finished) open(a);
    }
  };
  ws.onclose = (event) => {
    if (event.code === 1008) {  // the key was refused: trying again changes nothing
      statusLine.textContent = "disconnected: " + (event.reason || "unauthorized");
      return;
    }
    statusLine.textContent = "reconnecting…" + (event.reason ? " (" + event.reason + ")" : "");
    setTimeout(connect, retryMs);
    retryMs = Math.min(retryMs * 2, 2000);
  };
  ws.onmessage = (event) => onFrame(JSON.parse(event.data));
}

// On a (new) socket: resume an accepted stream, or send a request not yet accepted again.
function open(a) {
  if (a.token) {
    a.resuming = true;
    send({type: "stream.resume", resume_token: a.token, after_seq: a.lastSeq, attempt: a.attempt});
  } else {
    send(a.request);
  }
}

function cancel(a) {
  a.stopRequested = true;
  // An edge takes a cancel from the socket that owns the stream: after acceptance or resume.
  if (a.requestId && !a.resuming) send({type: "chat.cancel", request_id: a.requestId});
}

function render(a) {
  a.el.innerHTML = renderMarkdown(a.text);
  log.scrollTop = log.scrollHeight;
}

function finish(a) {
  a.finished = true;
  if (current === a) current = null;
  sendButton.disabled = false;
  stopButton.disabled = true;
}

function timingsLine(a, f) {
  const t = f.timings, n = f.usage.completion_tokens;
  const decodeS = (t.total_ms - t.ttft_ms) / 1000;
  const rate = n > 1 && decodeS > 0 ? (n - 1) / decodeS : n / Math.max(t.total_ms / 1000, 1e-3);
  const cut = f.finish_reason === "length" ? " · cut at max tokens" : "";
  const el = line("meta timings",
    `${n} tokens · TTFT ${Math.round(t.ttft_ms)} ms · ${rate.toFixed(1)} tokens/s` +
    ` · queue ${Math.round(t.queue_ms)} ms · batch of ${t.batch_size}${cut}`);
  el.dataset.requestId = f.request_id;
  el.dataset.finishReason = f.finish_reason;
}

function onFrame(f) {
  const a = f.type === "chat.accepted" || (f.type === "error" && !f.request_id)
    ? byClient.get(f.client_id) : byRequest.get(f.request_id);
  if (!a) {
    if (f.type === "error") line("error", `${f.code}: ${f.message}`);
    return;
  }
  if (a.finished) return;
  if (f.type === "chat.accepted") {
    if (a.requestId) return;
    a.requestId = f.request_id; a.token = f.resume_token;
    a.el.dataset.requestId = f.request_id;
    byRequest.set(f.request_id, a);
    if (a.stopRequested) cancel(a);
  } else if (f.type === "stream.resumed") {
    a.resuming = false;
    if (a.stopRequested) cancel(a);
  } else if (f.type === "chat.reset") {
    if (f.attempt <= a.attempt) return;
    a.attempt = f.attempt; a.lastSeq = -1; a.text = "";
    render(a);
  } else if (f.type === "chat.delta") {
    if (f.seq <= a.lastSeq) return;  // shown already (a replay after a resume)
    if (f.seq !== a.lastSeq + 1) {
      finish(a); line("error", "the stream lost deltas; it cannot be shown whole"); return;
    }
    a.lastSeq = f.seq; a.text += f.text;
    render(a);
  } else if (f.type === "chat.done") {
    finish(a);
    conversation.push({role: "assistant", content: a.text});
    timingsLine(a, f);
  } else if (f.type === "error") {
    if (a.resuming && f.code === "overloaded") {  // Kafka away: resume again later
      a.resuming = false;
      setTimeout(() => { if (!a.finished) open(a); }, f.retry_after_ms || 1000);
      return;
    }
    finish(a);
    if (f.code === "cancelled" && a.stopRequested) {
      if (a.text) conversation.push({role: "assistant", content: a.text});
      line("meta stopped", `stopped after ${a.lastSeq + 1} tokens`);
    } else {
      line("error", `${f.code}: ${f.message}`);
    }
  }
}

document.getElementById("form").onsubmit = (e) => {
  e.preventDefault();
  if (current) return;
  const input = document.getElementById("prompt");
  const clientId = "c" + (++counter);
  line("user", input.value);
  conversation.push({role: "user", content: input.value});
  const el = line("assistant", "");
  const a = {
    clientId, el, requestId: null, token: null, attempt: 0, lastSeq: -1, text: "",
    finished: false, resuming: false, stopRequested: false,
    request: {type: "chat.request", client_id: clientId, messages: conversation.slice(),
              priority: document.getElementById("priority").value, ...sampling()},
  };
  byClient.set(clientId, a);
  current = a;
  sendButton.disabled = true;
  stopButton.disabled = false;
  send(a.request);
  input.value = "";
};
// The answer's bound (the max-tokens field, always set: an unbounded answer of a small model
// can run to the end of its context) and the temperature, when filled in; blank, the model's
// own sampling defaults apply (0: greedy, the same answer every time).
function sampling() {
  const t = document.getElementById("temperature").value;
  const fields = {max_tokens: Number(document.getElementById("max-tokens").value)};
  if (t !== "") fields.temperature = Number(t);
  return fields;
}
stopButton.onclick = () => { if (current) cancel(current); };
connect();
