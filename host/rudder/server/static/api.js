// Talking to the server: the API key (kept in this browser's local storage), JSON calls,
// Server-Sent Event streams, and errors as messages a person can act on.

const KEY = "rudder.apiKey";

export function apiKey() {
  return localStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY, key);
  else localStorage.removeItem(KEY);
}

export class APIError extends Error {
  constructor(status, message, body) {
    super(message);
    this.status = status;
    this.param = body && body.param;
    this.type = body && body.type;
  }
}

function headers(extra = {}) {
  const h = { ...extra };
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function errorOf(response) {
  let error = null;
  try {
    error = (await response.json()).error;
  } catch (_) { /* not JSON: the status says enough */ }
  return new APIError(response.status, error ? error.message : `HTTP ${response.status} ${response.statusText}`, error);
}

async function call(path, options) {
  const response = await fetch(path, options);
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

export const getJSON = (path) => call(path, { headers: headers() });

export const postJSON = (path, body, signal) =>
  call(path, { method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body), signal });

export const postBytes = (path, bytes) =>
  call(path, { method: "POST", headers: headers({ "Content-Type": "application/wasm" }), body: bytes });

// The JSON payloads of a Server-Sent Events response to a POST, until [DONE] or the end.
// An error object in the stream (OpenAI's shape) is thrown as an APIError.
export async function* stream(path, body, signal) {
  const response = await fetch(path, {
    method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body), signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const payload = JSON.parse(data);
        if (payload.error) throw new APIError(200, payload.error.message, payload.error);
        yield payload;
      }
    }
  }
}

// What to tell the person: a refused key says where to enter one.
export function describe(error) {
  if (error.name === "AbortError") return "stopped";
  if (error.status === 401) {
    return `The server refused the API key: ${error.message}. Enter a valid key in the field at the top right.`;
  }
  if (error.status === 403) return `Not allowed for this key: ${error.message}`;
  if (error.status === 429) return `The server is busy: ${error.message}`;
  const where = error.param ? ` (${error.param})` : "";
  return error instanceof APIError ? `${error.message}${where}` : `Could not reach the server: ${error.message}`;
}
