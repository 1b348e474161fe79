// Bar charts drawn as inline SVG (no chart library): one labelled bar per group.
const NS = "http://www.w3.org/2000/svg";

function node(tag, attrs, text) {
  const n = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, String(v));
  if (text !== undefined) n.textContent = text;
  return n;
}

function format(value) {
  if (!Number.isInteger(value)) return value.toFixed(value < 1 ? 4 : 2);
  return value >= 10000 ? `${(value / 1000).toFixed(1)}k` : String(value);
}

// points: [{label, value}]; the SVG is an image with a text title and description for
// screen readers, and each bar carries its own <title> (a tooltip on hover).
export function barChart(title, points, unit) {
  const width = 720;
  const height = 220;
  const pad = { top: 20, right: 10, bottom: 40, left: 10 };
  const id = `chart-${Math.random().toString(36).slice(2)}`;
  const svg = node("svg", {
    viewBox: `0 0 ${width} ${height}`, role: "img", "aria-labelledby": `${id}-t ${id}-d`,
  });
  svg.append(node("title", { id: `${id}-t` }, title));
  const described = points.map((p) => `${p.label}: ${format(p.value)} ${unit}`).join("; ");
  svg.append(node("desc", { id: `${id}-d` }, described || "no data"));
  const max = Math.max(...points.map((p) => p.value), 0) || 1;
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  const slot = plotW / Math.max(points.length, 1);
  const barW = Math.min(60, slot * 0.7);
  svg.append(node("line", {
    class: "axis", x1: pad.left, x2: width - pad.right,
    y1: pad.top + plotH, y2: pad.top + plotH,
  }));
  if (!points.length) {
    svg.append(node("text", { x: width / 2, y: height / 2, "text-anchor": "middle" }, "no usage yet"));
  }
  points.forEach((p, i) => {
    const h = (p.value / max) * plotH;
    const x = pad.left + i * slot + (slot - barW) / 2;
    const y = pad.top + plotH - h;
    const bar = node("rect", {
      class: "bar", x, y, width: barW, height: Math.max(h, 1), "data-label": p.label,
      "data-value": p.value,
    });
    bar.append(node("title", {}, `${p.label}: ${format(p.value)} ${unit}`));
    svg.append(bar);
    svg.append(node("text", { class: "value", x: x + barW / 2, y: y - 4, "text-anchor": "middle" },
      format(p.value)));
    svg.append(node("text", {
      x: x + barW / 2, y: pad.top + plotH + 16, "text-anchor": "middle",
    }, p.label.length > 14 ? `${p.label.slice(0, 13)}…` : p.label));
  });
  return svg;
}
