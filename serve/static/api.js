// The server's HTTP API as the page uses it: JSON calls, Server-Sent Event streams, the API key.

const KEY_STORE = "omnidit.apiKey"; // sessionStorage: this tab only, never part of the page

/** An error answer from the server: its message (for people), the field it names and its code. */
export class ApiError extends Error {
  constructor(status, message, param = null, code = null) {
    super(message);
    this.status = status;
    this.param = param;
    this.code = code;
  }

  static async from(response) {
    let body = null;
    try {
      body = await response.json();
    } catch {
      // not JSON: fall through to the status line
    }
    const err = body && body.error;
    if (err && err.message) return new ApiError(response.status, err.message, err.param, err.code);
    return new ApiError(response.status, `The server answered ${response.status} ${response.statusText}.`);
  }

  get needsKey() {
    return this.status === 401;
  }
}

export class Api {
  constructor(base = "") {
    this.base = base;
    this.key = sessionStorage.getItem(KEY_STORE) || "";
  }

  setKey(key) {
    this.key = key;
    if (key) sessionStorage.setItem(KEY_STORE, key);
    else sessionStorage.removeItem(KEY_STORE);
  }

  headers(extra = {}) {
    return this.key ? { ...extra, Authorization: `Bearer ${this.key}` } : extra;
  }

  async fetch(path, options = {}) {
    let response;
    try {
      response = await fetch(this.base + path, { ...options, headers: this.headers(options.headers) });
    } catch (e) {
      if (e.name === "AbortError") throw e;
      throw new ApiError(0, "Cannot reach the server. Is `omnidit serve` still running?");
    }
    if (!response.ok) throw await ApiError.from(response);
    return response;
  }

  async json(path, options = {}) {
    return (await this.fetch(path, options)).json();
  }

  /** POST ``body`` as JSON; resolves to the Response once the server accepted it (else its ApiError). */
  async post(path, body, signal, accept = "application/json") {
    return this.fetch(path, {
      method: "POST",
      body: JSON.stringify(body),
      headers: { "Content-Type": "application/json", Accept: accept },
      signal,
    });
  }

  /** POST ``body`` with ``stream: true``; resolves once the server accepted the request (or throws
   * its ApiError), to an async iterator of the stream's events (parsed JSON) up to ``[DONE]``. */
  async stream(path, body, signal) {
    return sseEvents(await this.post(path, { ...body, stream: true }, signal, "text/event-stream"));
  }
}

/** The events (parsed JSON) of a Server-Sent Events response, up to ``[DONE]`` or its end. */
export async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  } finally {
    reader.releaseLock();
  }
}
