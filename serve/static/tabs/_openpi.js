// The robot WebSocket (/v1/realtime/robot/openpi) from the page: the protocol the stock
// openpi-client speaks. The server sends the policy's metadata first; each binary msgpack frame
// the page sends (an observation, or {"reset": true}) gets one binary reply; an error arrives as
// a text frame. The server closes the connection after most errors (1011), but keeps it open after
// "busy: ..." and "queue_full: ..." (a refused frame the robot may resend): the page ends the
// episode on any text frame, and the Robot tab closes the connection when an episode ends, so a
// refused session never holds a slot (tests/test_playground_robot.py).
//
// A browser cannot set the Authorization header on a WebSocket, so with an API key the page
// offers two subprotocols: "omnidit.openpi" and "omnidit.key.<the key, base64url>"; the server
// checks the key at the handshake and accepts "omnidit.openpi". The key never goes in the URL.

import { decode, encode } from "../msgpack.js";

export const PATH = "v1/realtime/robot/openpi";
export const PROTOCOL = "omnidit.openpi";
export const KEY_PROTOCOL = "omnidit.key.";

/** An error on the robot connection, in words for the person at the page. */
export class RobotError extends Error {}

/** base64url of the UTF-8 bytes of ``text`` (no padding): a valid subprotocol token. */
export function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  let raw = "";
  for (const b of bytes) raw += String.fromCharCode(b);
  return btoa(raw).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

/** The socket's URL on the page's own server, for policy ``model``. */
export function socketUrl(model) {
  const url = new URL(PATH, document.baseURI);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  url.searchParams.set("model", model);
  return url.href;
}

/** One connection: ``await PolicySocket.open(model, key)``, then ``infer(frame)`` per frame. */
export class PolicySocket {
  constructor(ws) {
    this.ws = ws;
    this.inbox = []; // replies not yet asked for
    this.waiting = null; // {resolve, reject} of the frame awaiting its reply
    this.failure = null; // once set, the connection is over: every call rejects with it
    this.serverText = null;
    ws.binaryType = "arraybuffer";
    ws.addEventListener("message", (e) => this.onMessage(e));
    ws.addEventListener("close", (e) => this.onClose(e));
  }

  /** Connect to policy ``model``; resolves once the server's metadata arrived. */
  static open(model, key) {
    const protocols = key ? [PROTOCOL, KEY_PROTOCOL + base64url(key)] : [];
    const socket = new PolicySocket(new WebSocket(socketUrl(model), protocols));
    return socket.next().then((metadata) => {
      socket.metadata = metadata;
      return socket;
    });
  }

  /** Send ``frame`` (a dict; NdArray values are numpy arrays) and resolve to the server's reply. */
  infer(frame) {
    if (this.failure) return Promise.reject(this.failure);
    this.ws.send(encode(frame));
    return this.next();
  }

  next() {
    if (this.inbox.length) return Promise.resolve(this.inbox.shift());
    if (this.failure) return Promise.reject(this.failure);
    return new Promise((resolve, reject) => (this.waiting = { resolve, reject }));
  }

  onMessage(e) {
    if (typeof e.data === "string") { // the server's error: the episode ends here
      this.serverText = e.data;
      return this.fail(new RobotError(`The server stopped the episode: ${e.data}`));
    }
    let reply;
    try {
      reply = decode(new Uint8Array(e.data));
    } catch (err) {
      return this.fail(new RobotError(`The server's reply could not be read (${err.message}).`));
    }
    if (this.waiting) {
      this.waiting.resolve(reply);
      this.waiting = null;
    } else {
      this.inbox.push(reply);
    }
  }

  onClose(e) {
    if (this.failure) return;
    let words;
    if (this.closing) words = "The robot connection was closed by the page.";
    else if (this.metadata === undefined) {
      words = "The server refused the robot connection or could not be reached. Is `omnidit serve` still "
        + "running (and the API key still valid)?";
    } else if (e.code === 1000) {
      words = `The server closed the robot connection${e.reason ? ` (${e.reason})` : ""}.`;
    } else {
      const why = `WebSocket close code ${e.code}${e.reason ? `: ${e.reason}` : ""}`;
      words = `The connection to the server was lost (${why}). `
        + "Is `omnidit serve` still running?";
    }
    this.fail(new RobotError(words));
  }

  fail(err) {
    if (this.failure) return;
    this.failure = err;
    if (this.waiting) {
      this.waiting.reject(err);
      this.waiting = null;
    }
  }

  close() {
    this.closing = true;
    if (this.ws.readyState <= WebSocket.OPEN) this.ws.close(1000);
  }
}
