// API keys: create (the secret is shown once, with a copy button; optional expiry and allowed
// models), list with limits, models, expiry and last use, rotate (a new secret, the old one
// working 24 h more), revoke.
import { del, get, post } from "./api.js";
import { $, badge, el, fill, guard, table, when } from "./ui.js";

const GRACE_S = 24 * 3600; // how long a rotated key's old secret keeps working

export function init() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    guard(create);
  });
  $("key-copy").addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText($("key-secret").value);
      $("key-copy").textContent = "Copied";
    } catch {
      $("key-secret").select(); // no clipboard permission: leave it selected for Ctrl+C
    }
  });
}

export async function show() {
  $("key-created").hidden = true;
  $("key-secret").value = "";
  await list();
}

const limit = (value) => (value === null || value === undefined ? "" : Number(value));

function reveal(secret, note) {
  $("key-created-note").textContent = note;
  $("key-secret").value = secret;
  $("key-copy").textContent = "Copy";
  $("key-created").hidden = false;
  $("key-secret").focus();
  $("key-secret").select();
}

async function create() {
  const body = {
    name: $("key-name").value,
    scopes: $("key-scope").value.split(","),
  };
  if ($("key-rpm").value) body.rpm_limit = limit($("key-rpm").value);
  if ($("key-tpm").value) body.tpm_limit = limit($("key-tpm").value);
  if ($("key-tenant").value.trim()) body.tenant_id = $("key-tenant").value.trim();
  // The browser's local time, as lists show it.
  if ($("key-expires").value) body.expires_at = new Date($("key-expires").value).toISOString();
  const models = $("key-models").value.split(",").map((m) => m.trim()).filter(Boolean);
  if (models.length) body.allowed_models = models;
  const key = await post("/v1/keys", body);
  reveal(key.key, "Copy this key now: it is shown only once.");
  await list();
}

async function rotate(k) {
  const key = await post(`/v1/keys/${encodeURIComponent(k.id)}/rotate`,
    { grace_period_seconds: GRACE_S });
  reveal(key.key, `New secret for ${k.name}, shown only once; the old one works until ` +
    `${when(key.previous_key_expires_at)}.`);
  await list();
}

function state(k) {
  if (k.revoked_at) return badge("revoked");
  if (k.expires_at && k.expires_at * 1000 <= Date.now()) return badge("expired");
  return el("span", { class: "row" },
    el("button", {
      type: "button", "aria-label": `Rotate key ${k.name} (${k.prefix})`,
      onclick: () => guard(() => rotate(k)),
    }, "Rotate"),
    el("button", {
      type: "button", class: "danger", "aria-label": `Revoke key ${k.name} (${k.prefix})`,
      onclick: () => guard(async () => {
        await del(`/v1/keys/${encodeURIComponent(k.id)}`);
        await list();
      }),
    }, "Revoke"));
}

async function list() {
  const res = await get("/v1/keys");
  const rows = res.data.map((k) => [
    k.name, el("code", {}, `${k.prefix}…`), k.scopes.join(", "),
    `${k.rpm_limit ?? "∞"} rpm · ${k.tpm_limit ?? "∞"} tpm`,
    k.allowed_models ? k.allowed_models.join(", ") : "all",
    k.expires_at ? when(k.expires_at) : "never", when(k.last_used_at), when(k.created_at),
    state(k),
  ]);
  fill("keys-list", table("API keys",
    ["name", "key", "scopes", "limits", "models", "expires", "last used", "created", ""], rows));
}
