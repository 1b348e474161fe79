// Console shell: sign in and out, what the key may do (tenant admin, platform admin), and
// navigation between views by the URL's hash (links work with the keyboard and Back).
import { ApiError, call, get, session } from "./api.js";
import { $, flash, guard } from "./ui.js";
import * as playground from "./playground.js";
import * as endpoints from "./endpoints.js";
import * as embeddings from "./embeddings.js";
import * as keys from "./keys.js";
import * as usage from "./usage.js";
import * as batches from "./batches.js";
import * as admin from "./admin.js";

const VIEWS = {
  playground, endpoints, embeddings, keys, usage, batches,
  tenants: { init: () => { admin.initTenants(); admin.initTenantUpdate(); }, show: admin.showTenants },
  fleet: { init: () => {}, show: admin.showFleet },
};
const role = { admin: false, platform: false, user: null };

async function probe() {
  // 401 here means a wrong or revoked key; 403 only that the key lacks the inference scope.
  try {
    await get("/v1/models");
  } catch (err) {
    if (!(err instanceof ApiError) || err.status !== 403) throw err;
  }
  try {
    await get("/v1/keys");
    role.admin = true;
  } catch (err) {
    if (!(err instanceof ApiError) || err.status !== 403) throw err;
    role.admin = false;
  }
  // /health answers its details to the platform admin only.
  const health = await (await call("GET", "/health", undefined, { raw: true })).json();
  role.platform = role.admin && "endpoints" in health;
  const me = await get("/v1/me");
  role.user = me.user ? `${me.user.email} (${me.role})` : null;
}

function allowed(needs) {
  return !needs || (needs === "admin" && role.admin) || (needs === "platform" && role.platform);
}

function route() {
  let name = location.hash.slice(1) || "playground";
  const link = document.querySelector(`#nav a[data-view="${CSS.escape(name)}"]`);
  if (!VIEWS[name] || !link || !allowed(link.dataset.needs)) name = "playground";
  for (const a of document.querySelectorAll("#nav a")) {
    if (a.dataset.view === name) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  for (const section of document.querySelectorAll(".view")) {
    section.hidden = section.id !== `view-${name}`;
  }
  flash("");
  window.scrollTo(0, 0);
  guard(() => VIEWS[name].show(role));
}

function enter() {
  for (const node of document.querySelectorAll("[data-needs]")) {
    const ok = allowed(node.dataset.needs);
    (node.closest("li") ?? node).hidden = !ok;
  }
  $("who").textContent = role.user ??
    (role.platform ? "platform admin" : role.admin ? "tenant admin" : "inference key");
  $("signin").hidden = true;
  $("shell").hidden = false;
  $("signout").hidden = false;
  route();
}

async function signIn(event) {
  event.preventDefault();
  const key = $("signin-key").value.trim();
  $("signin-error").textContent = "";
  session.set(key);
  try {
    await probe();
  } catch (err) {
    session.clear();
    $("signin-error").textContent = err.message;
    return;
  }
  $("signin-key").value = "";
  enter();
  $("main").focus({ preventScroll: true });
}

async function signOut() {
  // A console session (single sign-on) ends on the server too; an API key stays valid.
  if (session.key?.startsWith("sk-my-session-")) {
    try { await call("POST", "/v1/auth/logout"); } catch { /* gone already */ }
  }
  session.clear();
  location.hash = "";
  location.reload();
}

for (const view of Object.values(VIEWS)) view.init(role);
$("signin-form").addEventListener("submit", signIn);
$("signout").addEventListener("click", signOut);
window.addEventListener("hashchange", () => { if (session.key) route(); });
$("nav").addEventListener("click", () => $("main").focus({ preventScroll: true }));

if (session.key) {
  probe().then(enter, () => { session.clear(); $("signin-key").focus(); });
} else {
  $("signin-key").focus();
}
// Offer single sign-on when the platform has it.
call("GET", "/v1/auth/config", undefined, { raw: true })
  .then((res) => res.json())
  .then((config) => { $("sso").hidden = !config.oidc; }, () => {});
