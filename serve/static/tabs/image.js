// The image tab: a form within the chosen model's limits (GET /v1/models/{id}), one streamed
// request per submit (POST /v1/images/generations, "stream": true), several in flight at once.

import { el } from "../dom.js";
import { field, FormErrors, loadModelLimits, onSubmit, sizeFieldset } from "../form.js";
import { Job } from "../jobs.js";

// the server's ``param`` names -> this form's fields
const PARAMS = {
  prompt: "prompt", negative_prompt: "negative", size: "size", width: "size", height: "size",
  num_inference_steps: "steps", guidance_scale: "guidance", true_cfg_scale: "guidance", seed: "seed",
  n: "n", num_outputs: "n", model: "model",
};
const SHOWN_PX = 160; // small images are shown enlarged (pixelated) to at least this size

export default {
  kind: "image",
  label: "Image",
  mount(panel, ctx) {
    return new ImageTab(panel, ctx);
  },
};

class ImageTab {
  constructor(panel, { api, models, onAuthError }) {
    this.api = api;
    this.onAuthError = onAuthError;
    this.details = null;
    const number = (attrs = {}) => ({ type: "number", inputmode: "numeric", ...attrs });
    const f = (this.f = {
      model: field("image-model", "Model", "select"),
      prompt: field("image-prompt", "Prompt", "textarea", { rows: "2", placeholder: "the digit 7" }),
      negative: field("image-negative", "Negative prompt (optional)", "textarea", { rows: "1" }),
      steps: field("image-steps", "Steps", "input", number({ step: "1" })),
      guidance: field("image-guidance", "Guidance", "input", number({ step: "0.1", min: "0", inputmode: "decimal" })),
      seed: field("image-seed", "Seed (empty: random)", "input", number({ step: "1", min: "0" })),
      n: field("image-n", "Images", "input", number({ step: "1", min: "1" })),
    });
    for (const m of models) f.model.input.append(el("option", { value: m.id, text: m.id }));
    f.model.input.addEventListener("change", () => this.loadModel());
    const size = sizeFieldset("image", f);
    const submit = el("button", { type: "submit", class: "primary", text: "Generate" });
    this.general = el("p", { class: "field-error", id: "image-form-error", role: "alert" });
    this.form = el("form", { class: "card image-form", novalidate: "", "aria-label": "Image request" },
      f.model.wrap, f.prompt.wrap, f.negative.wrap, size,
      el("div", { class: "row" }, f.steps.wrap, f.guidance.wrap, f.seed.wrap, f.n.wrap),
      el("div", { class: "row" }, submit, el("span", { class: "note", text: "Ctrl+Enter in a text box submits too." })),
      this.general);
    this.errors = new FormErrors(f, this.general, PARAMS);
    onSubmit(this.form, () => this.submit());
    this.jobs = el("ol", { class: "jobs", "aria-label": "Image requests" });
    panel.append(this.form, this.jobs);
    this.loadModel();
  }

  /** Fetch the chosen model's defaults and limits and set the form to them. */
  async loadModel() {
    this.details = await loadModelLimits(this);
    if (!this.details) return;
    const d = this.details;
    const defaults = d.defaults || {};
    Object.assign(this.f.steps.input, { value: defaults.num_inference_steps ?? "", min: d.min_steps ?? 1, max: d.max_steps ?? "" });
    Object.assign(this.f.n.input, { value: 1, max: d.max_outputs ?? "" });
    this.f.guidance.input.value = defaults[d.cfg_param] ?? "";
    this.f.guidance.wrap.querySelector("label").textContent = `Guidance (${d.cfg_param})`;
    this.f.negative.input.value = defaults.negative_prompt ?? "";
  }

  body() {
    const f = this.f;
    const num = (input) => (input.value === "" ? undefined : Number(input.value));
    const d = this.details || { defaults: {} };
    const body = {
      model: f.model.input.value,
      prompt: f.prompt.input.value,
      num_inference_steps: num(f.steps.input),
      seed: num(f.seed.input),
      n: num(f.n.input),
      response_format: "b64_json",
    };
    const w = f.size.width.value || d.defaults.width;
    const h = f.size.height.value || d.defaults.height;
    if (w && h) body.size = `${w}x${h}`;
    if (f.negative.input.value) body.negative_prompt = f.negative.input.value;
    if (d.cfg_param && f.guidance.input.value !== "") body[d.cfg_param] = num(f.guidance.input);
    return body;
  }

  async submit() {
    this.errors.clear();
    const body = this.body();
    const controller = new AbortController();
    let events;
    try {
      events = await this.api.stream("v1/images/generations", body, controller.signal);
    } catch (e) {
      if (e.needsKey) this.onAuthError(e);
      return this.errors.show(e);
    }
    const job = new Job(this.jobs, body.prompt, () => controller.abort());
    const [w, h] = (body.size || "").split("x").map(Number);
    await job.follow(events, (event) => this.image(event, body, job, w, h));
  }

  image(event, body, job, w, h) {
    const src = `data:image/png;base64,${event.b64_json}`;
    const img = el("img", { src, alt: `Image ${event.index + 1} of request #${job.id}: ${body.prompt}` });
    if (w && h) {
      const scale = Math.max(1, Math.floor(SHOWN_PX / Math.max(w, h)));
      img.style.width = `${w * scale}px`;
    }
    const link = el("a", { href: src, download: `omnidit-${job.id}-${event.index + 1}.png`, text: "Download" });
    return el("figure", { class: "output" }, img, el("figcaption", {}, link));
  }
}
