// The playground: one message asked of a model and (optionally) another beside it, e.g. the tuned model and its
// base, both answers streamed from /v1/chat/completions. ?model=A&compare=B&ask=TEXT asks on load (a link to share;
// the headless-browser test uses it). Everything is served by finetune serve-model itself: no CDN.
"use strict";
const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
let models = [];
const histories = {};  // model id -> its conversation so far

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("apikey").value || localStorage.getItem("finetune-api-key");
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function api(path, body) {
  const r = await fetch(path, body === undefined ? {headers: headers()} :
    {method: "POST", headers: headers(), body: JSON.stringify(body)});
  if (r.status === 401) $("keybox").hidden = false;
  return r;
}

function setStatus(text) { $("status").textContent = text; }

async function loadModels() {
  const r = await api("/v1/models");
  if (!r.ok) { setStatus((await r.json()).error.message); return false; }
  models = (await r.json()).data.filter((m) => m.kind !== "classifier");
  $("model").replaceChildren();
  $("compare").replaceChildren(new Option("(none)", ""));
  for (const sel of [$("model"), $("compare")]) {
    for (const m of models) sel.add(new Option(m.id + (m.base_of ? " (base of " + m.base_of + ")" : ""), m.id));
  }
  const first = models.find((m) => m.base) || models[0];
  if (first) {
    $("model").value = params.get("model") || first.id;
    $("compare").value = params.has("compare") ? params.get("compare") : (first.base || "");
  }
  await renderPanes();
  return true;
}

function chosen() { return [$("model").value, $("compare").value].filter((x, i, a) => x && a.indexOf(x) === i); }

async function renderPanes() {
  const panes = $("panes");
  panes.replaceChildren();
  for (const id of chosen()) {
    const pane = document.createElement("section");
    pane.className = "pane";
    pane.dataset.model = id;
    const h = document.createElement("h2");
    h.textContent = id;
    const card = document.createElement("details");
    card.innerHTML = "<summary>model card</summary><pre></pre>";
    const log = document.createElement("div");
    log.className = "log";
    pane.append(h, card, log);
    panes.append(pane);
    for (const t of histories[id] || []) addTurn(id, t.role, t.content);
    api("/v1/models/" + encodeURIComponent(id)).then((r) => r.json())
      .then((m) => { card.querySelector("pre").textContent = m.card || "(no card)"; });
  }
}

function addTurn(id, role, text) {
  const pane = document.querySelector(`.pane[data-model="${CSS.escape(id)}"] .log`);
  const div = document.createElement("div");
  div.className = "turn " + role;
  div.textContent = text;
  pane.append(div);
  return div;
}

async function ask(id, text, system) {
  const history = histories[id] = histories[id] || [];
  if (system && !history.length) history.push({role: "system", content: system});
  history.push({role: "user", content: text});
  addTurn(id, "user", text);
  const out = addTurn(id, "assistant", "");
  out.dataset.state = "streaming";
  const body = {model: id, messages: history, stream: true, stream_options: {include_usage: true},
                temperature: Number($("temperature").value || 0)};
  if ($("max_tokens").value) body.max_tokens = Number($("max_tokens").value);
  const started = performance.now();
  let answer = "", usage = null;
  try {
    const r = await api("/v1/chat/completions", body);
    if (!r.ok) throw new Error((await r.json()).error.message);
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let at;
      while ((at = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, at).replace(/^data: /, "");
        buf = buf.slice(at + 2);
        if (line === "[DONE]") continue;
        const event = JSON.parse(line);
        if (event.error) throw new Error(event.error.message);
        if (event.usage) usage = event.usage;
        const piece = event.choices.length ? event.choices[0].delta.content : null;
        if (piece) { answer += piece; out.textContent = answer; }
      }
    }
    history.push({role: "assistant", content: answer});
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.textContent = `${usage ? usage.completion_tokens + " tokens, " : ""}${Math.round(performance.now() - started)} ms`;
    out.after(meta);
    out.dataset.state = "done";
  } catch (e) {
    history.pop();
    out.className = "turn error";
    out.textContent = String(e.message || e);
    out.dataset.state = "error";
  }
}

async function send(ev) {
  if (ev) ev.preventDefault();
  const text = $("message").value.trim();
  if (!text) return;
  $("message").value = "";
  document.body.dataset.state = "asking";
  $("send").disabled = true;
  await Promise.all(chosen().map((id) => ask(id, text, $("system").value.trim())));
  $("send").disabled = false;
  document.body.dataset.state = "ready";
}

$("ask").addEventListener("submit", send);
$("message").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) send(e); });
$("model").addEventListener("change", renderPanes);
$("compare").addEventListener("change", renderPanes);
$("clear").addEventListener("click", () => { for (const k in histories) delete histories[k]; renderPanes(); });
$("apikey").addEventListener("change", () => { localStorage.setItem("finetune-api-key", $("apikey").value); loadModels(); });

loadModels().then((ok) => {
  document.body.dataset.state = "ready";
  if (ok && params.get("ask")) { $("message").value = params.get("ask"); send(); }
});
