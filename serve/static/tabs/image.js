// The image tab: a form within the chosen model's limits (GET /v1/models/{id}), one streamed
// request per submit, several in flight at once. From text: POST /v1/images/generations ("stream":
// true). With an input image (the drop zone, mask brush and strength of _image_input.js): POST
// /v1/images/edits, multipart as OpenAI defines it. A LoRA adapter the server holds may be picked.

import { sseEvents } from "../api.js";
import { el } from "../dom.js";
import { field, FormErrors, loadModelLimits, onSubmit, sizeFieldset } from "../form.js";
import { Job } from "../jobs.js";
import { ImageInput } from "./_image_input.js";
import { LoraPicker } from "./_lora.js";

// the server's ``param`` names -> this form's fields
const PARAMS = {
  prompt: "prompt", negative_prompt: "negative", size: "size", width: "size", height: "size",
  "height/width/num_outputs": "size", num_inference_steps: "steps", guidance_scale: "guidance",
  true_cfg_scale: "guidance", seed: "seed", n: "n", num_outputs: "n", model: "model", image: "image", "image[]": "image",
  mask: "image", strength: "strength", lora: "lora", loras: "lora",
};
const SHOWN_PX = 160; // small images are shown enlarged (pixelated) to at least this size
const EXAMPLE_PROMPT = "the digit 7"; // what the embedded digits model draws; any model takes it

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
      prompt: field("image-prompt", "Prompt", "textarea", { rows: "2" }),
      negative: field("image-negative", "Negative prompt (optional)", "textarea", { rows: "1" }),
      steps: field("image-steps", "Steps", "input", number({ step: "1" })),
      guidance: field("image-guidance", "Guidance", "input", number({ step: "0.1", min: "0", inputmode: "decimal" })),
      seed: field("image-seed", "Seed (empty: random)", "input", number({ step: "1", min: "0" })),
      n: field("image-n", "Images", "input", number({ step: "1", min: "1" })),
    });
    f.prompt.input.value = EXAMPLE_PROMPT; // a working request as the page opens: press Generate
    for (const m of models) f.model.input.append(el("option", { value: m.id, text: m.id }));
    f.model.input.addEventListener("change", () => this.loadModel());
    const size = sizeFieldset("image", f);
    this.input = new ImageInput((w, h) => this.imageSize(w, h));
    f.image = { input: this.input.file, error: this.input.error };
    f.strength = { input: this.input.strength, error: this.input.strengthError };
    this.lora = new LoraPicker(api);
    f.lora = { input: this.lora.pick.input, error: this.lora.pick.error };
    const submit = el("button", { type: "submit", class: "primary", text: "Generate" });
    this.general = el("p", { class: "field-error", id: "image-form-error", role: "alert" });
    this.form = el("form", { class: "card image-form", novalidate: "", "aria-label": "Image request" },
      f.model.wrap, f.prompt.wrap, f.negative.wrap, this.input.root, size,
      el("div", { class: "row" }, f.steps.wrap, f.guidance.wrap, f.seed.wrap, f.n.wrap), this.lora.root,
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
    const model = this.f.model.input.value;
    this.lora.refresh(model);
    this.details = await loadModelLimits(this);
    if (!this.details) return;
    const d = this.details;
    const defaults = d.defaults || {};
    Object.assign(this.f.steps.input, { value: defaults.num_inference_steps ?? "", min: d.min_steps ?? 1, max: d.max_steps ?? "" });
    Object.assign(this.f.n.input, { value: 1, max: d.max_outputs ?? "" });
    this.f.guidance.input.value = defaults[d.cfg_param] ?? "";
    this.f.guidance.wrap.querySelector("label").textContent = `Guidance (${d.cfg_param})`;
    this.f.negative.input.value = defaults.negative_prompt ?? "";
    this.input.setInputs(d.inputs);
    if (this.input.loaded) this.imageSize(this.input.picture.naturalWidth, this.input.picture.naturalHeight);
  }

  /** An input image was loaded (its natural size) or removed (no arguments): the output size follows it,
   * rounded to the model's multiple; without an image, back to the model's default size. */
  imageSize(w, h) {
    const d = this.details;
    if (!d) return;
    const { width, height } = this.f.size;
    if (w === undefined) {
      width.value = d.defaults?.width ?? "";
      height.value = d.defaults?.height ?? "";
      return;
    }
    const k = d.size_multiple || 1;
    const fit = (x) => Math.min(Math.max(k, Math.round(x / k) * k), d.max_side || Infinity);
    width.value = fit(w);
    height.value = fit(h);
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
    const lora = this.lora.value();
    if (lora) body.lora = lora;
    return body;
  }

  async submit() {
    this.errors.clear();
    const body = this.body();
    const controller = new AbortController();
    let events;
    try {
      events = this.input.loaded ? await this.edit(body, controller.signal)
        : await this.api.stream("v1/images/generations", body, controller.signal);
    } catch (e) {
      if (e.needsKey) this.onAuthError(e);
      return this.errors.show(e);
    }
    const job = new Job(this.jobs, body.prompt, () => controller.abort());
    const [w, h] = (body.size || "").split("x").map(Number);
    await job.follow(events, (event) => this.image(event, body, job, w, h));
  }

  /** POST /v1/images/edits (multipart): the input image and mask at the request's size, the form's
   * fields as form fields. Resolves to the answer's events: the stream's, or the images of a JSON answer. */
  async edit(body, signal) {
    const [w, h] = (body.size || "").split("x").map(Number);
    if (!w || !h) throw Object.assign(new Error("Please set the width and height of the result."), { param: "size" });
    const { image, mask } = await this.input.files(w, h);
    body.strength = Number(this.input.strength.value);
    const form = new FormData();
    form.append("image", image, "image.png");
    if (mask) form.append("mask", mask, "mask.png");
    for (const [name, value] of Object.entries({ ...body, stream: true })) {
      if (value !== undefined) form.append(name, typeof value === "object" ? JSON.stringify(value) : String(value));
    }
    const response = await this.api.fetch("v1/images/edits",
      { method: "POST", body: form, headers: { Accept: "text/event-stream" }, signal });
    if ((response.headers.get("Content-Type") || "").startsWith("text/event-stream")) return sseEvents(response);
    const answer = await response.json();
    return (async function* images() {
      for (const [index, data] of answer.data.entries()) yield { ...data, index };
    })();
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
