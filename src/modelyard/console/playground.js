// Streaming chat playground: tokens appear as SSE chunks arrive (fetch + ReadableStream), with
// time to first token and tokens per second measured in the browser.
import { get, stream } from "./api.js";
import { $, flash, options } from "./ui.js";

let controller = null;

export function init() {
  $("chat-form").addEventListener("submit", send);
  $("chat-stop").addEventListener("click", () => controller?.abort());
  $("chat-model").addEventListener("change", showDefaults);
}

// Each chat model's sampling defaults (GET /v1/models): the fields left empty take them.
let defaults = {};

export async function show() {
  const models = await loadModels("chat-model", "chat");
  defaults = Object.fromEntries(models.map((m) => [m.id, m.sampling_defaults || {}]));
  showDefaults();
}

// The models of one kind (chat, embedding...) into a picker; the models listed.
export async function loadModels(selectId, kind) {
  const models = (await get("/v1/models")).data.filter((m) => m.kind === kind);
  options($(selectId), models.map((m) => m.id));
  if (!models.length) flash(`No ${kind} model is deployed that this key can use.`);
  return models;
}

// An empty Temperature field sends none, so the model's default applies: say which it is.
function showDefaults() {
  const value = defaults[$("chat-model").value]?.temperature;
  $("chat-temperature").placeholder = value === undefined ? "model default" : `model default: ${value}`;
}

function setStat(id, text) { $(id).textContent = text; }

async function send(event) {
  event.preventDefault();
  const form = new FormData($("chat-form"));
  const messages = [];
  if (form.get("system").trim()) messages.push({ role: "system", content: form.get("system") });
  messages.push({ role: "user", content: form.get("prompt") });
  const body = {
    model: form.get("model"),
    messages,
    max_tokens: Number(form.get("max_tokens")),
    stream: true,
    stream_options: { include_usage: true },
  };
  // Only what the user set: the endpoint's sampling defaults fill the rest.
  if (form.get("temperature").trim() !== "") body.temperature = Number(form.get("temperature"));
  const output = $("chat-output");
  output.textContent = "";
  output.classList.add("streaming");
  output.setAttribute("aria-busy", "true");
  for (const id of ["chat-ttft", "chat-tps", "chat-tokens"]) setStat(id, "…");
  flash("");
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  controller = new AbortController();
  const started = performance.now();
  let first = null;
  let chunks = 0;
  let usage = null;
  try {
    for await (const chunk of stream("/v1/chat/completions", body, controller.signal)) {
      if (chunk.usage) usage = chunk.usage;
      const text = chunk.choices?.[0]?.delta?.content;
      if (!text) continue;
      const now = performance.now();
      if (first === null) {
        first = now;
        setStat("chat-ttft", `${Math.round(first - started)} ms`);
      }
      chunks += 1;
      output.append(text);
      output.scrollTop = output.scrollHeight;
      setStat("chat-tokens", String(chunks));
      // Chunks arrive in bursts: a rate over less than a quarter second would mislead.
      if (now - first > 250) setStat("chat-tps", ((chunks - 1) / ((now - first) / 1000)).toFixed(1));
    }
    const tokens = usage?.completion_tokens ?? chunks;
    setStat("chat-tokens", String(tokens));
    if (first !== null) {
      const seconds = (performance.now() - first) / 1000;
      if (seconds > 0 && tokens > 1) setStat("chat-tps", ((tokens - 1) / seconds).toFixed(1));
      else setStat("chat-tps", "–");
    }
  } catch (err) {
    if (err.name !== "AbortError") flash(err.message);
  } finally {
    output.classList.remove("streaming");
    output.removeAttribute("aria-busy");
    if (first === null) setStat("chat-ttft", "–");
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
    controller = null;
  }
}
