// The audio tab's text-to-speech form (POST /v1/audio/speech). The speech is streamed as it is
// made (``stream_format: "sse"``, raw 16-bit PCM pieces), the card counts the seconds received, and
// the whole utterance plays in an <audio> element (a WAV built here) once the stream ends.

import { sseEvents } from "../api.js";
import { el } from "../dom.js";
import { field, FormErrors, onSubmit, setOptions } from "../form.js";
import { Job } from "../jobs.js";
import { fromBase64, mediaFigure, wavBlob } from "../media.js";

// the server's ``param`` names -> this form's fields
const PARAMS = { input: "text", voice: "voice", speed: "speed", seed: "seed", model: "model" };
const EXAMPLE_TEXT = "three one four"; // words the embedded tts model speaks

export class SpeechForm {
  /** ``models``: the server's speech models, each with its ``details`` (GET /v1/models/{id}). */
  constructor(panel, { api, models, onAuthError }) {
    this.api = api;
    this.models = new Map(models.map((m) => [m.id, m.details]));
    this.onAuthError = onAuthError;
    const f = (this.f = {
      model: field("speech-model", "Model", "select"),
      text: field("speech-text", "Text", "textarea", { rows: "2", "aria-describedby": "speech-text-hint" }),
      voice: field("speech-voice", "Voice", "select"),
      speed: field("speech-speed", "Speed", "select"),
      seed: field("speech-seed", "Seed (empty: random)", "input", { type: "number", inputmode: "numeric", step: "1", min: "0" }),
    });
    this.hint = el("p", { class: "hint", id: "speech-text-hint" });
    f.text.wrap.insertBefore(this.hint, f.text.error);
    setOptions(f.model.input, models.map((m) => [m.id, m.id]));
    f.text.input.value = EXAMPLE_TEXT; // a working request as the page opens: press Speak
    f.model.input.addEventListener("change", () => this.loadModel());
    this.general = el("p", { class: "field-error", id: "speech-form-error", role: "alert" });
    const title = el("h2", { id: "speech-title", text: "Text to speech" });
    this.form = el("form", { class: "card speech-form", novalidate: "", "aria-labelledby": title.id },
      title, f.model.wrap, f.text.wrap, el("div", { class: "row" }, f.voice.wrap, f.speed.wrap, f.seed.wrap),
      el("div", { class: "row" }, el("button", { type: "submit", class: "primary", text: "Speak" }),
        el("span", { class: "note", text: "Ctrl+Enter in the text submits too." })),
      this.general);
    this.errors = new FormErrors(f, this.general, PARAMS);
    onSubmit(this.form, () => this.submit());
    this.jobs = el("ol", { class: "jobs", "aria-label": "Speech requests" });
    panel.append(this.form, this.jobs);
    this.loadModel();
  }

  get details() {
    return this.models.get(this.f.model.input.value);
  }

  /** Offer the chosen model's voices and speeds, and say which words it speaks. */
  loadModel() {
    const d = this.details;
    this.errors.clear();
    setOptions(this.f.voice.input, Object.entries(d.voices || {}).map(([name, about]) =>
      [name, about ? `${name} (${about})` : name]));
    setOptions(this.f.speed.input, (d.speeds || [1]).map((s) => [s, `${s}x`]), 1);
    const words = d.words || [];
    this.exampleFor(words);
    this.hint.textContent = words.length
      ? `Words this model speaks: ${words.join(", ")}; at most ${d.max_words} words.`
      : "";
  }

  /** While the text is an untouched example, keep it to words the chosen model speaks. */
  exampleFor(words) {
    const text = this.f.text.input;
    if (text.value !== (this.example ?? EXAMPLE_TEXT) || !words.length) return;
    const fits = EXAMPLE_TEXT.split(" ").every((w) => words.includes(w));
    this.example = text.value = fits ? EXAMPLE_TEXT : words.slice(0, 3).join(" ");
  }

  body() {
    const { model, text, voice, speed, seed } = this.f;
    const body = {
      model: model.input.value, input: text.input.value, voice: voice.input.value, speed: Number(speed.input.value),
      response_format: "pcm", stream_format: "sse",
    };
    if (seed.input.value !== "") body.seed = Number(seed.input.value);
    return body;
  }

  async submit() {
    this.errors.clear();
    const body = this.body();
    const controller = new AbortController();
    let response;
    try {
      response = await this.api.post("v1/audio/speech", body, controller.signal, "text/event-stream");
    } catch (e) {
      if (e.needsKey) this.onAuthError(e);
      return this.errors.show(e);
    }
    const rate = Number(response.headers.get("X-Sample-Rate")) || this.details.sample_rate;
    const job = new Job(this.jobs, body.input, () => controller.abort());
    job.busy("speaking");
    const parts = [];
    let bytes = 0;
    let complete = false;
    try {
      for await (const event of sseEvents(response)) {
        if (event.type === "speech.audio.delta") {
          const piece = fromBase64(event.audio);
          parts.push(piece);
          bytes += piece.length;
          job.busy("streaming", `${(bytes / 2 / rate).toFixed(2)} s of audio received`);
        } else if (event.type === "speech.audio.done") {
          complete = true;
        }
      }
    } catch (e) {
      if (e.name === "AbortError") return job.cancelled();
      return job.fail(`The speech stream broke off before it was complete (${e.message}).`);
    }
    if (!complete) return job.fail("The server closed the stream before the speech was complete.");
    const seconds = bytes / 2 / rate;
    job.output(mediaFigure("audio", wavBlob(parts, rate), `Speech of request #${job.id}: ${body.input}`,
      `omnidit-speech-${job.id}.wav`));
    job.done(`done: ${seconds.toFixed(2)} s, voice ${body.voice}`);
  }
}
