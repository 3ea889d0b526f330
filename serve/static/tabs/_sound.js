// The audio tab's text-to-audio form (Stable Audio and other audio families: POST
// /v1/audio/generate). The route answers with the whole clip when it is made, so the card shows
// an indeterminate bar until then and plays the WAV in an <audio> element. Cancel closes the
// request, which aborts it in the engine.

import { el } from "../dom.js";
import { field, FormErrors, onSubmit, setOptions } from "../form.js";
import { Job } from "../jobs.js";
import { mediaFigure } from "../media.js";

// the server's ``param`` names -> this form's fields
const PARAMS = {
  prompt: "prompt", negative_prompt: "negative", seconds: "seconds", num_inference_steps: "steps",
  guidance_scale: "guidance", seed: "seed", model: "model",
};

export class SoundForm {
  /** ``models``: the server's text-to-audio models, each with its ``details`` (GET /v1/models/{id}). */
  constructor(panel, { api, models, onAuthError }) {
    this.api = api;
    this.models = new Map(models.map((m) => [m.id, m.details]));
    this.onAuthError = onAuthError;
    const number = (attrs = {}) => ({ type: "number", inputmode: "numeric", step: "1", min: "1", ...attrs });
    const f = (this.f = {
      model: field("sound-model", "Model", "select"),
      prompt: field("sound-prompt", "Prompt", "textarea", { rows: "2" }),
      negative: field("sound-negative", "Negative prompt (optional)", "textarea", { rows: "1" }),
      seconds: field("sound-seconds", "Seconds", "input", number({ step: "any", min: "0", inputmode: "decimal" })),
      steps: field("sound-steps", "Steps", "input", number()),
      guidance: field("sound-guidance", "Guidance", "input", number({ step: "0.1", min: "0", inputmode: "decimal" })),
      seed: field("sound-seed", "Seed (empty: random)", "input", number({ min: "0" })),
    });
    f.prompt.input.value = "rain on a roof"; // a working request as the page opens
    setOptions(f.model.input, models.map((m) => [m.id, m.id]));
    f.model.input.addEventListener("change", () => this.loadModel());
    this.general = el("p", { class: "field-error", id: "sound-form-error", role: "alert" });
    const title = el("h2", { id: "sound-title", text: "Text to audio" });
    this.form = el("form", { class: "card sound-form", novalidate: "", "aria-labelledby": title.id },
      title, f.model.wrap, f.prompt.wrap, f.negative.wrap,
      el("div", { class: "row" }, f.seconds.wrap, f.steps.wrap, f.guidance.wrap, f.seed.wrap),
      el("div", { class: "row" }, el("button", { type: "submit", class: "primary", text: "Generate audio" }),
        el("span", { class: "note", text: "Ctrl+Enter in a text box submits too." })),
      this.general);
    this.errors = new FormErrors(f, this.general, PARAMS);
    onSubmit(this.form, () => this.submit());
    this.jobs = el("ol", { class: "jobs", "aria-label": "Audio requests" });
    panel.append(this.form, this.jobs);
    this.loadModel();
  }

  /** Set the form to the chosen model's defaults and its longest clip. */
  loadModel() {
    const d = this.models.get(this.f.model.input.value);
    const defaults = d.defaults || {};
    this.errors.clear();
    Object.assign(this.f.seconds.input, { value: d.max_seconds ?? "", max: d.max_seconds ?? "" });
    this.f.seconds.wrap.querySelector("label").textContent = d.max_seconds ? `Seconds (at most ${d.max_seconds})` : "Seconds";
    this.f.steps.input.value = defaults.num_inference_steps ?? "";
    this.f.guidance.input.value = defaults.guidance_scale ?? "";
    this.f.negative.input.value = defaults.negative_prompt ?? "";
  }

  body() {
    const f = this.f;
    const num = (input) => (input.value === "" ? undefined : Number(input.value));
    const body = {
      model: f.model.input.value, prompt: f.prompt.input.value, seconds: num(f.seconds.input),
      num_inference_steps: num(f.steps.input), guidance_scale: num(f.guidance.input), seed: num(f.seed.input),
      response_format: "wav",
    };
    if (f.negative.input.value) body.negative_prompt = f.negative.input.value;
    return body;
  }

  async submit() {
    this.errors.clear();
    const body = this.body();
    const controller = new AbortController();
    // the answer is the finished clip, so the card shows at once; a refusal removes it again
    const job = new Job(this.jobs, body.prompt, () => controller.abort());
    job.busy("generating");
    let response;
    try {
      response = await this.api.post("v1/audio/generate", body, controller.signal, "audio/wav");
    } catch (e) {
      if (e.name === "AbortError") return job.cancelled();
      if (e.param || e.status === 400 || e.needsKey) { // refused: say why next to the field
        job.discard();
        if (e.needsKey) this.onAuthError(e);
        return this.errors.show(e);
      }
      return job.fail(e.message);
    }
    let blob;
    try {
      blob = await response.blob();
    } catch (e) {
      return e.name === "AbortError" ? job.cancelled() : job.fail(e.message);
    }
    job.output(mediaFigure("audio", blob, `Audio of request #${job.id}: ${body.prompt}`, `omnidit-audio-${job.id}.wav`));
    const rate = response.headers.get("X-Sample-Rate");
    job.done(rate ? `done: ${rate} Hz, ${response.headers.get("X-Audio-Channels")} channel(s)` : "done");
  }
}
