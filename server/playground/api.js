// Calls to this server's public API: the key the user entered (kept for this tab only),
// URLs relative to the page (so a --root-path prefix works), OpenAI error objects, and
// JSON that keeps 64-bit seeds exact.

const KEY_STORAGE = "diffbatch.apiKey";

export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) ?? "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

/** An error the server answered (its OpenAI error object), or a failed connection. */
export class APIError extends Error {
  constructor(message, status = 0, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

// Seeds go up to 2^63-1, past what a JS number holds exactly: the page keeps them as BigInt
// and reads and writes them as their digits (JSON.rawJSON, JSON.parse's source text).

/** JSON text of `value`; a BigInt is written as its exact digits. */
function stringify(value) {
  return JSON.stringify(value, (_, v) =>
    typeof v === "bigint" ? (JSON.rawJSON?.(String(v)) ?? Number(v)) : v,
  );
}

/** The value of JSON `text`; `seed` fields become exact BigInts where the browser allows. */
export function parseJSON(text) {
  return JSON.parse(text, (key, value, context) =>
    key === "seed" && context?.source ? BigInt(context.source) : value,
  );
}

/** The page lives at <root>/playground/; the API at <root>/v1/..., /metrics. */
function urlOf(path) {
  return new URL(`../${path.replace(/^\//, "")}`, document.baseURI);
}

function authorization() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

/** fetch() with the key; resolves to an OK response, or throws an APIError with the server's message. */
export async function call(path, { method = "GET", json, form, signal } = {}) {
  const headers = authorization();
  let body;
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = stringify(json);
  } else if (form !== undefined) {
    body = form; // the browser writes the multipart boundary itself
  }
  let response;
  try {
    response = await fetch(urlOf(path), { method, headers, body, signal });
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new APIError(`cannot reach the server (${error.message})`);
  }
  if (!response.ok) throw await errorOf(response);
  return response;
}

export async function getJSON(path, options) {
  return (await call(path, options)).json();
}

async function errorOf(response) {
  const text = await response.text();
  try {
    const { error } = JSON.parse(text);
    if (error?.message) return new APIError(error.message, response.status, error.code ?? null);
  } catch {
    // not JSON: a proxy's own error page
  }
  const detail = text.slice(0, 200) || response.statusText;
  return new APIError(`HTTP ${response.status}: ${detail}`, response.status);
}

/** The served models: each {id, parent, kind, modes, endpoints, loaded}; an adapter (LoRA), a
 * ControlNet or an IP-Adapter names its base model in parent, the last two with their kind ("controlnet",
 * "ip_adapter"); endpoints (image, edit, video) is null until the model has loaded once. */
export async function listModels() {
  const { data } = await getJSON("v1/models");
  return data.map((model) => ({
    id: model.id,
    parent: model.parent ?? null,
    kind: model.kind ?? null,
    modes: model.modes ?? null, // a union ControlNet's modes' names, by number
    endpoints: model.endpoints ?? null,
    loaded: model.loaded ?? null,
    state: model.state ?? null,
  }));
}

// A model that is not loaded, as the select shows it (`state` of /v1/models).
const NOT_LOADED = {
  parked: "in host memory, back on use",
  loading: "loading",
  failed: "failed to load",
};

/** How the model select shows a model: its id, what it makes, and whether it is loaded. */
export function modelLabel(model) {
  const makes = model.endpoints ? ` · ${model.endpoints.join(", ")}` : "";
  const state =
    model.loaded === false ? ` · ${NOT_LOADED[model.state] ?? "loads on first use"}` : "";
  return `${model.id}${makes}${state}`;
}
