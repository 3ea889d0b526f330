// Media results shared by the tabs: a playable <video> or <audio> of a Blob with a Download link,
// and a WAV file around raw 16-bit PCM (what the speech stream sends).

import { el } from "./dom.js";

/** A figure holding a ``tag`` ("video" or "audio") element that plays ``blob``, labelled ``label``,
 * with a link that saves it as ``filename``. ``attrs`` go on the media element. */
export function mediaFigure(tag, blob, label, filename, attrs = {}) {
  const src = URL.createObjectURL(blob); // the page fetched it with the API key: no bare URL would do
  const media = el(tag, { src, controls: "", preload: "auto", "aria-label": label, ...attrs });
  const link = el("a", { href: src, download: filename, text: "Download" });
  return el("figure", { class: `output output-${tag}` }, media, el("figcaption", {}, link));
}

/** The bytes of base64 ``text``. */
export function fromBase64(text) {
  const raw = atob(text);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  return bytes;
}

/** A WAV Blob of 16-bit little-endian PCM ``parts`` (Uint8Arrays, in order) at ``rate`` Hz. */
export function wavBlob(parts, rate, channels = 1) {
  const size = parts.reduce((n, p) => n + p.length, 0);
  const head = new DataView(new ArrayBuffer(44));
  const text = (at, s) => [...s].forEach((c, i) => head.setUint8(at + i, c.charCodeAt(0)));
  text(0, "RIFF");
  head.setUint32(4, 36 + size, true);
  text(8, "WAVE");
  text(12, "fmt ");
  head.setUint32(16, 16, true); // the fmt chunk's size
  head.setUint16(20, 1, true); // PCM
  head.setUint16(22, channels, true);
  head.setUint32(24, rate, true);
  head.setUint32(28, rate * channels * 2, true); // bytes per second
  head.setUint16(32, channels * 2, true); // bytes per frame
  head.setUint16(34, 16, true); // bits per sample
  text(36, "data");
  head.setUint32(40, size, true);
  return new Blob([head, ...parts], { type: "audio/wav" });
}
