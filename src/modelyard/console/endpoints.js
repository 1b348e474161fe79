// Endpoints (status, replicas, version, recent errors) and deploys from the registry, with a
// deploy's loading progress polled from GET /v1/endpoints/{id}.
import { del, get, post } from "./api.js";
import { $, badge, el, fill, guard, options, table } from "./ui.js";

let polling = null;

export function init() {
  $("deploy-form").addEventListener("submit", (event) => {
    event.preventDefault();
    guard(deploy);
  });
  $("deploy-artifact").addEventListener("change", () => {
    $("deploy-name").value = $("deploy-artifact").value.split(":")[0];
  });
}

export async function show() {
  await Promise.all([list(), registry()]);
}

function replicaSummary(ep) {
  const r = ep.replicas;
  const states = r.items.map((i) => i.state).join(", ");
  return `${r.ready}/${r.desired} ready${states ? ` (${states})` : ""}`;
}

async function list() {
  const res = await get("/v1/endpoints");
  const rows = res.data.map((ep) => [
    el("strong", {}, ep.model_name), badge(ep.status), replicaSummary(ep),
    ep.rollout_from ? `${ep.model_artifact} (rolling out from ${ep.rollout_from})`
      : ep.model_artifact,
    ep.status_message || ep.replicas.last_error || "–",
    el("button", {
      type: "button", class: "danger", "aria-label": `Delete endpoint ${ep.model_name}`,
      onclick: () => guard(async () => {
        if (!confirm(`Delete ${ep.model_name}? In-flight requests drain first.`)) return;
        await del(`/v1/endpoints/${encodeURIComponent(ep.endpoint_id)}`);
        await list();
      }),
    }, "Delete"),
  ]);
  fill("endpoints-list", table("Your endpoints",
    ["model", "status", "replicas", "version", "last message", ""], rows,
    "No endpoints yet: deploy one from the registry below."));
}

async function registry() {
  const res = await get("/v1/registry/models");
  const refs = res.data.flatMap((m) => m.versions.map((v) => `${m.name}:${v.version}`));
  options($("deploy-artifact"), refs);
  if (!$("deploy-name").value && refs.length) $("deploy-name").value = refs[0].split(":")[0];
}

async function deploy() {
  const min = Number($("deploy-min").value);
  const max = Math.max(Number($("deploy-max").value), min, 1);
  const res = await post("/v1/models/deploy", {
    model_name: $("deploy-name").value,
    model_artifact: $("deploy-artifact").value,
    hardware: { min_replicas: min, max_replicas: max },
  });
  watch(res.endpoint_id, res.estimated_ready_seconds || 10);
  await list();
}

function watch(endpointId, estimate) {
  clearInterval(polling);
  const started = Date.now();
  const bar = el("progress", { max: "100", value: "0", "aria-label": "Deploy progress" });
  const line = el("p", {}, "provisioning…");
  fill("deploy-progress", line, bar);
  polling = setInterval(async () => {
    let ep;
    try {
      ep = await get(`/v1/endpoints/${encodeURIComponent(endpointId)}`);
    } catch (err) {
      line.textContent = err.message;
      clearInterval(polling);
      return;
    }
    const elapsed = (Date.now() - started) / 1000;
    const done = ["ready", "failed", "unschedulable", "degraded"].includes(ep.status);
    bar.value = done ? 100 : Math.min(95, (100 * elapsed) / estimate);
    line.textContent = `${ep.model_name}: ${ep.status} after ${elapsed.toFixed(0)} s — ` +
      `${replicaSummary(ep)}${ep.status_message ? ` — ${ep.status_message}` : ""}`;
    if (done) {
      clearInterval(polling);
      list().catch(() => {});
    }
  }, 1000);
}
