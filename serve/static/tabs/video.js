// The video tab: a form within the chosen model's limits (GET /v1/models/{id}); each submit creates
// a job (POST /v1/videos), the card follows it (GET /v1/videos/{id}: status and progress) and plays
// the MP4 (GET /v1/videos/{id}/content) when it is done. Cancel deletes the job, which aborts it.

import { el } from "../dom.js";
import { explain } from "../errors.js";
import { field, FormErrors, loadModelLimits, onSubmit, sizeFieldset } from "../form.js";
import { Job } from "../jobs.js";
import { mediaFigure } from "../media.js";

// the server's ``param`` names -> this form's fields
const PARAMS = {
  prompt: "prompt", negative_prompt: "negative", size: "size", width: "size", height: "size",
  num_frames: "frames", seconds: "frames", fps: "fps", num_inference_steps: "steps", guidance_scale: "guidance",
  seed: "seed", model: "model",
};
const POLL_MS = 250; // unless the server's openai-poll-after-ms says otherwise
const SHOWN_PX = 160; // small videos are shown enlarged (pixelated) to at least this size
const EXAMPLE_PROMPT = "a 3 moving left"; // what the embedded digits_video model makes; any model takes it

export default {
  kind: "video",
  label: "Video",
  mount(panel, ctx) {
    return new VideoTab(panel, ctx);
  },
};

class VideoTab {
  constructor(panel, { api, models, onAuthError }) {
    this.api = api;
    this.onAuthError = onAuthError;
    this.details = null;
    const number = (attrs = {}) => ({ type: "number", inputmode: "numeric", step: "1", ...attrs });
    const f = (this.f = {
      model: field("video-model", "Model", "select"),
      prompt: field("video-prompt", "Prompt", "textarea", { rows: "2" }),
      negative: field("video-negative", "Negative prompt (optional)", "textarea", { rows: "1" }),
      frames: field("video-frames", "Frames", "input", number({ min: "1", "aria-describedby": "video-frames-hint" })),
      fps: field("video-fps", "Frames per second", "input", number({ min: "1", max: "120" })),
      steps: field("video-steps", "Steps", "input", number({ min: "1" })),
      guidance: field("video-guidance", "Guidance", "input", number({ step: "0.1", min: "0", inputmode: "decimal" })),
      seed: field("video-seed", "Seed (empty: random)", "input", number({ min: "0" })),
    });
    this.framesHint = el("p", { class: "hint", id: "video-frames-hint" });
    f.frames.wrap.insertBefore(this.framesHint, f.frames.error);
    f.prompt.input.value = EXAMPLE_PROMPT; // a working request as the page opens: press Generate video
    for (const m of models) f.model.input.append(el("option", { value: m.id, text: m.id }));
    f.model.input.addEventListener("change", () => this.loadModel());
    const submit = el("button", { type: "submit", class: "primary", text: "Generate video" });
    this.general = el("p", { class: "field-error", id: "video-form-error", role: "alert" });
    this.form = el("form", { class: "card video-form", novalidate: "", "aria-label": "Video request" },
      f.model.wrap, f.prompt.wrap, f.negative.wrap, sizeFieldset("video", f),
      el("div", { class: "row" }, f.frames.wrap, f.fps.wrap, f.steps.wrap, f.guidance.wrap, f.seed.wrap),
      el("div", { class: "row" }, submit, el("span", { class: "note", text: "Ctrl+Enter in a text box submits too." })),
      this.general);
    this.errors = new FormErrors(f, this.general, PARAMS);
    onSubmit(this.form, () => this.submit());
    this.jobs = el("ol", { class: "jobs", "aria-label": "Video requests" });
    panel.append(this.form, this.jobs);
    this.loadModel();
  }

  /** Fetch the chosen model's defaults and limits and set the form to them. */
  async loadModel() {
    this.details = await loadModelLimits(this);
    if (!this.details) return;
    const d = this.details;
    const defaults = d.defaults || {};
    const k = d.frame_step || 1;
    const base = d.frame_base ?? k + 1; // the model makes base + k j frames
    Object.assign(this.f.frames.input, { value: defaults.num_frames ?? "", min: base, step: k });
    this.framesHint.textContent = k > 1 ? `frames: ${[0, 1, 2].map((j) => base + k * j).join(", ")}, …` : "";
    this.f.fps.input.value = d.fps ?? "";
    this.f.steps.input.value = defaults.num_inference_steps ?? "";
    this.f.guidance.input.value = defaults.guidance_scale ?? "";
    this.f.negative.input.value = defaults.negative_prompt ?? "";
  }

  body() {
    const f = this.f;
    const num = (input) => (input.value === "" ? undefined : Number(input.value));
    const body = {
      model: f.model.input.value,
      prompt: f.prompt.input.value,
      num_frames: num(f.frames.input),
      fps: num(f.fps.input),
      num_inference_steps: num(f.steps.input),
      guidance_scale: num(f.guidance.input),
      seed: num(f.seed.input),
    };
    if (f.size.width.value && f.size.height.value) body.size = `${f.size.width.value}x${f.size.height.value}`;
    if (f.negative.input.value) body.negative_prompt = f.negative.input.value;
    return body;
  }

  async submit() {
    this.errors.clear();
    const body = this.body();
    let video;
    try {
      video = await (await this.api.post("v1/videos", body)).json();
    } catch (e) {
      if (e.needsKey) this.onAuthError(e);
      return this.errors.show(e);
    }
    const state = { cancelled: false };
    const job = new Job(this.jobs, body.prompt, () => this.cancel(video.id, job, state));
    const steps = body.num_inference_steps ?? this.details?.defaults?.num_inference_steps;
    await this.follow(video, job, state, steps);
  }

  /** Poll the job until it ends; a completed one is fetched and shown as a playable video. */
  async follow(video, job, state, steps) {
    try {
      while (!state.cancelled) {
        if (video.status === "completed") return this.show(video, job);
        if (video.status === "failed") return job.fail(video.error ? explain(video.error) : "The video could not be made.");
        if (video.status === "in_progress") job.progress(video.progress, 100, steps ? `${video.progress}% of ${steps} steps` : `${video.progress}%`);
        const response = await this.api.fetch(`v1/videos/${video.id}`);
        const wait = Number(response.headers.get("openai-poll-after-ms")) || POLL_MS;
        video = await response.json();
        if (video.status === "queued" || video.status === "in_progress") await sleep(wait);
      }
    } catch (e) {
      if (!state.cancelled) job.fail(e.message);
    }
  }

  async show(video, job) {
    job.progress(100, 100, "100%, downloading the MP4");
    const blob = await (await this.api.fetch(`v1/videos/${video.id}/content`)).blob();
    const [w, h] = video.size.split("x").map(Number);
    const figure = mediaFigure("video", blob, `Video of request #${job.id}: ${video.prompt}`,
      `omnidit-${job.id}.mp4`, { loop: "", muted: "", playsinline: "" });
    const scale = Math.max(1, Math.floor(SHOWN_PX / Math.max(w, h)));
    figure.querySelector("video").style.width = `${w * scale}px`;
    job.output(figure);
    job.progress(100, 100, `${video.seconds} s, ${Math.ceil(blob.size / 1024)} kB`);
    job.done(`done: ${video.num_frames} frames at ${video.fps} fps`);
  }

  async cancel(id, job, state) {
    state.cancelled = true;
    job.busy("cancelling");
    try {
      await this.api.fetch(`v1/videos/${id}`, { method: "DELETE" });
      job.cancelled();
    } catch (e) {
      job.fail(`Cancelling failed: ${e.message}`);
    }
  }
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
