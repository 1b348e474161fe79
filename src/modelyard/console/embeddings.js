// Embeddings try-out: one vector per line of text, shown by its size, norm and first values.
import { post } from "./api.js";
import { $, el, fill, guard, table } from "./ui.js";
import { loadModels } from "./playground.js";

export function init() {
  $("embed-form").addEventListener("submit", (event) => {
    event.preventDefault();
    guard(embed);
  });
}

export async function show() {
  await loadModels("embed-model", "embedding");
}

async function embed() {
  const input = $("embed-input").value.split("\n").filter((line) => line.trim());
  const res = await post("/v1/embeddings", { model: $("embed-model").value, input });
  const rows = res.data.map((d) => {
    const v = d.embedding;
    const norm = Math.sqrt(v.reduce((s, x) => s + x * x, 0));
    return [input[d.index], String(v.length), norm.toFixed(4),
      el("code", {}, v.slice(0, 6).map((x) => x.toFixed(4)).join(", ") + " …")];
  });
  fill("embed-result",
    table("Embeddings", ["text", "dimensions", "norm", "first values"], rows),
    el("p", { class: "muted" }, `${res.usage?.prompt_tokens ?? "?"} prompt tokens`));
}
