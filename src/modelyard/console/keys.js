// API keys: create (the secret is shown once, with a copy button), list with limits, revoke.
import { del, get, post } from "./api.js";
import { $, badge, el, fill, guard, table, when } from "./ui.js";

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

async function create() {
  const body = {
    name: $("key-name").value,
    scopes: $("key-scope").value.split(","),
  };
  if ($("key-rpm").value) body.rpm_limit = limit($("key-rpm").value);
  if ($("key-tpm").value) body.tpm_limit = limit($("key-tpm").value);
  if ($("key-tenant").value.trim()) body.tenant_id = $("key-tenant").value.trim();
  const key = await post("/v1/keys", body);
  $("key-secret").value = key.key;
  $("key-copy").textContent = "Copy";
  $("key-created").hidden = false;
  $("key-secret").focus();
  $("key-secret").select();
  await list();
}

async function list() {
  const res = await get("/v1/keys");
  const rows = res.data.map((k) => [
    k.name, el("code", {}, `${k.prefix}…`), k.scopes.join(", "),
    `${k.rpm_limit ?? "∞"} rpm · ${k.tpm_limit ?? "∞"} tpm`, when(k.created_at),
    k.revoked_at ? badge("revoked") : el("button", {
      type: "button", class: "danger", "aria-label": `Revoke key ${k.name} (${k.prefix})`,
      onclick: () => guard(async () => {
        await del(`/v1/keys/${encodeURIComponent(k.id)}`);
        await list();
      }),
    }, "Revoke"),
  ]);
  fill("keys-list", table("API keys", ["name", "key", "scopes", "limits", "created", ""], rows));
}
