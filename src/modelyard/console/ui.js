// Small DOM helpers: elements built with textContent only (API data is never parsed as HTML).
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export const $ = (id) => document.getElementById(id);

export function badge(text) {
  return el("span", { class: `badge ${String(text).replace(/[^a-z_]/gi, "")}` }, text);
}

// A table with a caption (for screen readers) from rows of cells (strings or nodes). Each cell
// carries its column's name: on a phone a row shows as a card of labelled cells (console.css).
export function table(caption, headers, rows, empty = "Nothing yet.") {
  if (!rows.length) return el("p", { class: "muted" }, empty);
  return el("div", { class: "table-wrap" },
    el("table", {},
      el("caption", { class: "sr-only" }, caption),
      el("thead", {}, el("tr", {}, headers.map((h) => el("th", { scope: "col" }, h)))),
      el("tbody", {}, rows.map((r) => el("tr", {},
        r.map((c, i) => el("td", { "data-label": headers[i] }, c)))))));
}

export function fill(id, ...nodes) { $(id).replaceChildren(...nodes.flat()); }

export function flash(message) { $("flash").textContent = message ?? ""; }

export function when(seconds) {
  return seconds ? new Date(seconds * 1000).toLocaleString() : "–";
}

export function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

// Run an action, showing the API's message in the alert region when it fails.
export async function guard(action) {
  try {
    flash("");
    return await action();
  } catch (err) {
    flash(err.message);
    return undefined;
  }
}

export function options(select, values, keep = true) {
  const old = select.value;
  select.replaceChildren(...values.map((v) => el("option", { value: v }, v)));
  if (keep && values.includes(old)) select.value = old;
}
