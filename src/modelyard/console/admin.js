// Platform admin views: tenants (tier, quota, ceilings) and the fleet (devices, the replicas
// placed on each, memory) with every endpoint's autoscaling decisions and their reasons.
import { get, patch, post } from "./api.js";
import { $, badge, bytes, el, fill, guard, options, table } from "./ui.js";

export function initTenants() {
  $("tenant-form").addEventListener("submit", (event) => {
    event.preventDefault();
    guard(async () => {
      const quota = $("tenant-quota").value;
      await post("/v1/tenants", {
        name: $("tenant-name").value,
        tier: $("tenant-tier").value,
        monthly_token_quota: quota ? Number(quota) : null,
      });
      $("tenant-form").reset();
      await showTenants();
    });
  });
}

const EDITABLE = ["monthly_token_quota", "max_rpm", "max_tpm", "max_concurrent_requests",
  "max_concurrent_batch_items", "max_endpoints", "max_replicas"];

export function initTenantUpdate() {
  $("tenant-update-form").addEventListener("submit", (event) => {
    event.preventDefault();
    guard(async () => {
      // Only what was filled in changes; "none" removes a limit.
      const body = {};
      if ($("tenant-update-tier").value) body.tier = $("tenant-update-tier").value;
      for (const name of EDITABLE) {
        const raw = $(`tenant-update-${name}`).value.trim();
        if (raw) body[name] = raw === "none" ? null : Number(raw);
      }
      const id = $("tenant-update-id").value;
      await patch(`/v1/tenants/${encodeURIComponent(id)}`, body);
      $("tenant-update-form").reset();
      await showTenants();
    });
  });
}

const unlimited = (v) => (v === null || v === undefined ? "∞" : String(v));

export async function showTenants() {
  const res = await get("/v1/tenants");
  const rows = res.data.map((t) => [
    el("strong", {}, t.name), el("code", {}, t.id), badge(t.tier),
    unlimited(t.monthly_token_quota),
    `rpm ${unlimited(t.max_rpm)} · tpm ${unlimited(t.max_tpm)} · concurrent ` +
      `${unlimited(t.max_concurrent_requests)} · endpoints ${unlimited(t.max_endpoints)} · ` +
      `replicas ${unlimited(t.max_replicas)}`,
  ]);
  fill("tenants-list", table("Tenants",
    ["name", "id", "tier", "monthly token quota", "ceilings"], rows));
  options($("tenant-update-id"), res.data.map((t) => t.id));
}

export async function showFleet() {
  const [devices, endpoints] = await Promise.all([get("/v1/devices"), get("/v1/endpoints")]);
  const owner = new Map(
    endpoints.data.flatMap((ep) => ep.replicas.items.map((r) => [r.id, ep.model_name])));
  const deviceRows = devices.data.map((d) => [
    el("strong", {}, d.name), d.kind,
    el("span", {}, el("progress", {
      max: String(Math.max(d.memory_bytes, 1)), value: String(d.used_bytes),
      "aria-label": `${d.name} memory used`,
    }), ` ${bytes(d.used_bytes)} of ${bytes(d.memory_bytes)}`),
    d.replicas.map((id) => (owner.has(id) ? `${owner.get(id)} (${id})` : id)).join(", ") || "–",
  ]);
  fill("fleet-devices", table("Devices", ["device", "kind", "memory", "replicas"], deviceRows));
  const decisions = endpoints.data.flatMap((ep) =>
    ep.autoscaling.recent_changes.map((d) => ({ ep, d })));
  const rows = decisions.slice(-50).reverse().map(({ ep, d }) => [
    el("strong", {}, ep.model_name), `${d.current} → ${d.desired}`, d.reason,
    d.panic ? badge("panic") : "–",
  ]);
  const summary = endpoints.data.map((ep) => [
    el("strong", {}, ep.model_name), badge(ep.status),
    `${ep.autoscaling.current} running, ${ep.autoscaling.desired} desired`,
    ep.autoscaling.last_decision?.reason ?? "–",
  ]);
  fill("fleet-scaling",
    table("Endpoints", ["endpoint", "status", "replicas", "last decision"], summary),
    el("h3", {}, "Recent replica changes"),
    table("Scaling changes", ["endpoint", "replicas", "reason", "panic"], rows,
      "No scaling changes yet."));
}
