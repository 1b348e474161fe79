// Usage this month: tokens, requests and cost (spend) per day, model, API key and team
// (GET /v1/usage?group_by=), drawn as SVG bar charts.
import { get } from "./api.js";
import { $, el, fill, guard } from "./ui.js";
import { barChart } from "./chart.js";

const UNITS = { total_tokens: "tokens", requests: "requests", cost_usd: "USD" };

export function init() {
  $("usage-metric").addEventListener("change", () => guard(show));
  $("usage-refresh").addEventListener("click", () => guard(show));
}

export async function show() {
  const metric = $("usage-metric").value;
  const [byDay, byModel, byKey, byTeam] = await Promise.all([
    get("/v1/usage?group_by=day"),
    get("/v1/usage?group_by=model"),
    get("/v1/usage?group_by=key"),
    get("/v1/usage?group_by=team"),
  ]);
  const t = byDay.totals;
  fill("usage-totals",
    ["requests", "total_tokens", "prompt_tokens", "completion_tokens", "cost_usd"].map((k) =>
      el("div", {}, el("dt", {}, k.replace("_", " ")),
        el("dd", {}, k === "cost_usd" ? `$${t[k].toFixed(4)}` : String(t[k])))));
  const unit = UNITS[metric];
  fill("usage-day", barChart(`${unit} per day`,
    byDay.data.map((g) => ({ label: g.day, value: g[metric] })), unit));
  fill("usage-model", barChart(`${unit} per model`,
    byModel.data.map((g) => ({ label: g.model, value: g[metric] })), unit));
  fill("usage-key", barChart(`${unit} per API key`,
    byKey.data.map((g) => ({ label: g.key, value: g[metric] })), unit));
  fill("usage-team", barChart(`${unit} per team`,
    byTeam.data.map((g) => ({ label: g.team || "(no team)", value: g[metric] })), unit));
}
