// Endpoints (status, replicas, versions and their traffic weights, recent errors, a starting
// replica's load progress) and deploys from the registry, with a deploy's loading progress polled from GET /v1/endpoints/{id}.
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
  await Promise.all([list(), registry(), adapters()]);
}

// The tenant's LoRA adapters served on shared bases: base, versions, loaded or cold.
async function adapters() {
  const res = await get("/v1/registry/adapters");
  const rows = res.data.map((a) => [a.name, a.base_model, a.versions.join(", "), a.state]);
  fill("adapters-list", table("Your adapters on shared bases",
    ["adapter", "base", "versions", "state"], rows,
    "No adapters: push one with `modelyard models push ./adapter --name NAME --base smollm2`."));
}

function replicaSummary(ep) {
  const r = ep.replicas;
  const states = r.items.map((i) => i.state).join(", ");
  return `${r.ready}/${r.desired} ready${states ? ` (${states})` : ""}`;
}

// Where each load phase sits on one bar: a replica reports {phase, fraction of that phase}.
const PHASES = { copying: [0, 30], loading: [30, 90], warming: [90, 99], ready: [100, 100] };

// The least advanced starting replica's load_progress, or null when none is loading.
export function loadingReplica(ep) {
  const loading = ep.replicas.items.map((r) => r.load_progress)
    .filter((p) => p && p.phase && p.phase !== "ready");
  if (!loading.length) return null;
  return loading.reduce((a, b) => (percent(a) <= percent(b) ? a : b));
}

function percent(p) {
  const [from, to] = PHASES[p.phase] || [0, 99];
  const fraction = Math.min(1, Math.max(0, Number(p.fraction) || 0));
  return Math.round(from + (to - from) * fraction);
}

// A progress bar for an endpoint with a loading replica ("–" when none is loading).
export function loadCell(ep) {
  const p = loadingReplica(ep);
  if (!p) return "–";
  const pct = percent(p);
  const phasePct = Math.round(100 * Math.min(1, Math.max(0, Number(p.fraction) || 0)));
  return el("span", { class: "load" },
    el("progress", { max: "100", value: String(pct),
      "aria-label": `${ep.model_name} loading: ${p.phase} ${phasePct}%` }),
    ` ${p.phase} ${phasePct}%`);
}

// The versions an endpoint serves and each one's share of the requests, largest first
// ("demo:1 90% · demo:2 10% canary"); one version alone is its artifact (and a rollout's source).
export function versionCell(ep) {
  const items = ep.versions?.items ?? [];
  const weights = ep.traffic && Object.keys(ep.traffic).length ? ep.traffic
    : Object.fromEntries(items.map((v) => [v.version_id, v.weight]));
  if (items.length < 2) {
    return ep.rollout_from ? `${ep.model_artifact} (rolling out from ${ep.rollout_from})`
      : ep.model_artifact;
  }
  const byId = new Map(items.map((v) => [v.version_id, v]));
  const ids = Object.keys(weights).sort((a, b) => (weights[b] ?? 0) - (weights[a] ?? 0));
  const parts = ids.map((id) => {
    const v = byId.get(id) ?? {};
    const role = v.role && v.role !== "stable" ? ` ${v.role}` : "";
    const warm = v.role === "previous" && !weights[id] ? " (warm)" : "";
    return `${v.model_artifact ?? id} ${weights[id] ?? 0}%${role}${warm}`;
  });
  const canary = ep.versions?.canary;
  return el("span", { class: "versions" }, parts.join(" · "),
    canary?.status ? el("small", { class: "muted" }, ` — canary ${canary.status}`) : null);
}

async function list() {
  const res = await get("/v1/endpoints");
  const rows = res.data.map((ep) => [
    el("strong", {}, ep.model_name), ep.model_kind || ep.kind || "–", badge(ep.status),
    replicaSummary(ep),
    versionCell(ep),
    loadCell(ep),
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
    ["model", "kind", "status", "replicas", "versions (traffic)", "loading", "last message", ""], rows,
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
    // The replicas' own report when there is one; else the deploy's estimate of the time.
    const loading = loadingReplica(ep);
    bar.value = done ? 100 : loading ? percent(loading)
      : Math.min(95, (100 * elapsed) / estimate);
    const phase = loading ? ` — ${loading.phase} ${percent(loading)}%` : "";
    line.textContent = `${ep.model_name}: ${ep.status} after ${elapsed.toFixed(0)} s — ` +
      `${replicaSummary(ep)}${phase}${ep.status_message ? ` — ${ep.status_message}` : ""}`;
    if (done) {
      clearInterval(polling);
      list().catch(() => {});
    }
  }, 1000);
}
