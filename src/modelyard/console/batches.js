// Files and batches: upload a JSONL file, start a batch on it, follow its progress, download its
// output and error files.
import { call, get, post } from "./api.js";
import { $, badge, el, fill, guard, table, when } from "./ui.js";

const FINAL = ["completed", "failed", "expired", "cancelled"];
let polling = null;

export function init() {
  $("batch-form").addEventListener("submit", (event) => {
    event.preventDefault();
    guard(start);
  });
}

export async function show() {
  await list();
}

async function start() {
  const file = $("batch-file").files[0];
  if (!file) return;
  const form = new FormData();
  form.append("purpose", "batch");
  form.append("file", file, file.name);
  $("batch-status").textContent = `Uploading ${file.name}…`;
  const uploaded = await post("/v1/files", form);
  const batch = await post("/v1/batches", {
    input_file_id: uploaded.id,
    endpoint: $("batch-endpoint").value,
    completion_window: "24h",
    metadata: { source: "console" },
  });
  $("batch-status").textContent = `Batch ${batch.id} created from ${uploaded.filename}.`;
  $("batch-form").reset();
  await list();
  follow(batch.id);
}

function follow(batchId) {
  clearInterval(polling);
  polling = setInterval(async () => {
    try {
      const batch = await get(`/v1/batches/${encodeURIComponent(batchId)}`);
      await list();
      if (FINAL.includes(batch.status)) {
        clearInterval(polling);
        $("batch-status").textContent = `Batch ${batch.id} ${batch.status}.`;
      }
    } catch (err) {
      clearInterval(polling);
      $("batch-status").textContent = err.message;
    }
  }, 1000);
}

async function download(fileId, name) {
  const res = await call("GET", `/v1/files/${encodeURIComponent(fileId)}/content`, undefined,
    { raw: true });
  const url = URL.createObjectURL(await res.blob());
  const link = el("a", { href: url, download: name });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

function progress(batch) {
  const c = batch.request_counts ?? { total: 0, completed: 0, failed: 0 };
  const done = c.completed + c.failed;
  return el("span", {},
    el("progress", {
      max: String(Math.max(c.total, 1)), value: String(done),
      "aria-label": `Batch ${batch.id}: ${done} of ${c.total} done`,
    }),
    ` ${c.completed}/${c.total} done${c.failed ? `, ${c.failed} failed` : ""}`);
}

function fileButton(fileId, label, name) {
  if (!fileId) return null;
  return el("button", {
    type: "button", class: "ghost", "aria-label": `Download ${label} of ${name}`,
    onclick: () => guard(() => download(fileId, `${name}-${label}.jsonl`)),
  }, `Download ${label}`);
}

async function list() {
  const res = await get("/v1/batches?limit=20");
  const rows = res.data.map((b) => [
    el("code", {}, b.id), badge(b.status), progress(b), when(b.created_at),
    el("span", { class: "row" }, fileButton(b.output_file_id, "results", b.id),
      fileButton(b.error_file_id, "errors", b.id)),
  ]);
  fill("batches-list", table("Batches", ["batch", "status", "progress", "created", "files"], rows,
    "No batches yet: upload a JSONL file of requests above."));
}
