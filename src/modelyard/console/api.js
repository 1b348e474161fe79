// The platform's HTTP API, called with the signed-in key as a Bearer header. The key lives in
// sessionStorage only: never in a URL, a cookie or localStorage, and it is gone with the tab.
const KEY = "modelyard.key";

export const session = {
  get key() { return sessionStorage.getItem(KEY); },
  set(key) { sessionStorage.setItem(KEY, key); },
  clear() { sessionStorage.removeItem(KEY); },
};

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function failure(res) {
  // The API's own message (OpenAI's {"error": {"message"}} shape, or OIP's {"error": "..."}).
  let message = `${res.status} ${res.statusText}`;
  let code = null;
  try {
    const body = await res.json();
    const err = body.error ?? body.detail;
    if (typeof err === "string") message = err;
    else if (err && err.message) { message = err.message; code = err.code ?? null; }
  } catch { /* not JSON: keep the status line */ }
  return new ApiError(res.status, message, code);
}

export async function call(method, path, body, options = {}) {
  const headers = { authorization: `Bearer ${session.key}` };
  let payload = body;
  if (body !== undefined && !(body instanceof FormData)) {
    headers["content-type"] = "application/json";
    payload = JSON.stringify(body);
  }
  const res = await fetch(path, { method, headers, body: payload, signal: options.signal });
  if (!res.ok) throw await failure(res);
  if (options.raw) return res;
  if (res.status === 204) return null;
  return res.json();
}

export const get = (path) => call("GET", path);
export const post = (path, body) => call("POST", path, body);
export const patch = (path, body) => call("PATCH", path, body);
export const del = (path) => call("DELETE", path);

// POST a streaming request and yield each SSE `data:` payload (parsed) as it arrives.
export async function* stream(path, body, signal) {
  const res = await call("POST", path, body, { raw: true, signal });
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue; // a comment (": loading …") or keep-alive
      if (data === "[DONE]") return;
      const parsed = JSON.parse(data);
      if (parsed.error) throw new ApiError(0, parsed.error.message ?? String(parsed.error));
      yield parsed;
    }
  }
}
