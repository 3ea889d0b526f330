// The robot tab (models of kind "actions": robot policies such as the embedded `reach`). The page
// simulates the reaching task (_reach.js) and drives it with the chosen policy over the robot
// WebSocket (_openpi.js), as a robot running the stock openpi-client would: a reset frame, then per
// cycle the camera image, state and instruction go out and an action chunk comes back; the arm
// executes the chunk's first EXEC_HORIZON actions at the chosen control rate (as
// dit_core.eval.policy.run_policy does) and the next cycle observes again, until the arm reaches
// the named target or the episode's steps run out.

import { el } from "../dom.js";
import { field, FormErrors, onSubmit } from "../form.js";
import { NdArray } from "../msgpack.js";
import { PolicySocket, RobotError } from "./_openpi.js";
import { CAMERA, COLOURS, MAX_STEPS, ReachSim, TARGET_RADIUS } from "./_reach.js";

const EXEC_HORIZON = 8; // actions executed per chunk before observing again (run_policy's default)
const SHOWN_PX = 320; // the 64x64 camera image, enlarged
const MAX_SEED = 2 ** 31 - 1;
// what the simulated task provides: a policy must read these (from its metadata frame)
const TASK = { image_keys: ["observation/image"], state_key: "observation/state", prompt_key: "prompt", state_dim: 4,
  action_dim: 2 };
const PARAMS = { num_inference_steps: "steps", seed: "seed", model: "model" }; // the server's names -> fields

export default {
  kind: "actions",
  label: "Robot",
  mount(panel, ctx) {
    return new RobotTab(panel, ctx);
  },
};

class RobotTab {
  constructor(panel, { api, models, onAuthError }) {
    this.api = api;
    this.onAuthError = onAuthError;
    this.running = null; // {socket, stopped} of the episode in progress
    if (!models.length) {
      panel.append(el("p", { class: "note", role: "status", text: "This server serves no robot policy (a model of "
        + "kind \"actions\"). Start it with one, e.g. `omnidit serve --model digits --model reach`." }));
      return;
    }
    const number = (attrs) => ({ type: "number", inputmode: "numeric", step: "1", ...attrs });
    const f = (this.f = {
      model: field("robot-model", "Policy", "select"),
      seed: field("robot-seed", "Episode seed", "input", number({ min: "0", max: String(MAX_SEED), value: "0" })),
      steps: field("robot-steps", "Denoising steps per chunk", "input", number({ min: "1" })),
      rate: field("robot-rate", "Control rate (steps per second)", "input",
        number({ min: "1", max: "1000", value: "10" })),
    });
    for (const m of models) f.model.input.append(el("option", { value: m.id, text: m.id }));
    f.model.input.addEventListener("change", () => this.loadModel());
    this.runButton = el("button", { type: "submit", class: "primary", text: "Run episode" });
    this.stopButton = el("button", { type: "button", text: "Stop", hidden: "" });
    this.stopButton.addEventListener("click", () => this.stop());
    this.general = el("p", { class: "field-error", id: "robot-error", role: "alert" });
    this.about = el("p", { class: "hint", id: "robot-about" });
    const form = el("form", { class: "card robot-form", novalidate: "", "aria-label": "Robot episode" },
      f.model.wrap, el("div", { class: "row" }, f.seed.wrap, f.steps.wrap, f.rate.wrap),
      el("div", { class: "row" }, this.runButton, this.stopButton), this.about, this.general);
    this.errors = new FormErrors(f, this.general, PARAMS);
    onSubmit(form, () => this.run());
    panel.append(form, this.arena());
    this.loadModel();
  }

  arena() {
    const out = (id, text = "–") => el("dd", { id, text });
    this.canvas = el("canvas", { id: "robot-arena", width: String(SHOWN_PX), height: String(SHOWN_PX), role: "img",
      "aria-label": "The simulated arena: no episode yet" });
    this.instruction = el("p", { id: "robot-instruction", text: "Press Run episode to start." });
    this.chunkList = el("ol", { id: "robot-chunk-list", class: "robot-chunks", "aria-label": "Action chunks" });
    this.out = {
      outcome: out("robot-outcome", "not started"), steps: out("robot-steps-taken"), chunks: out("robot-chunks"),
      latency: out("robot-latency"), server: out("robot-server-latency"), state: out("robot-state"),
      distance: out("robot-distance"),
    };
    this.out.outcome.setAttribute("role", "status");
    const row = (label, dd) => [el("dt", { text: label }), dd];
    const o = this.out;
    const facts = el("dl", { class: "robot-facts" }, ...row("Outcome", o.outcome), ...row("Steps taken", o.steps),
      ...row("Chunks received", o.chunks), ...row("Last chunk, round trip", o.latency),
      ...row("Last chunk, server", o.server), ...row("Arm (x, y)", o.state), ...row("Distance to target", o.distance));
    return el("section", { class: "card robot-arena", "aria-label": "Episode" }, this.instruction,
      el("div", { class: "robot-view" }, this.canvas, facts), this.chunkList);
  }

  /** The chosen policy's details (GET /v1/models/{id}); shows what the tab will do with it. */
  async loadModel() {
    this.errors.clear();
    try {
      this.details = (await this.api.json(`v1/models/${encodeURIComponent(this.f.model.input.value)}`)).details;
    } catch (e) {
      if (e.needsKey) this.onAuthError(e);
      this.details = null;
      return this.errors.show(e);
    }
    const d = this.details;
    this.f.steps.input.value = d.defaults?.num_inference_steps ?? "";
    this.about.textContent = `Chunks of ${d.action_horizon} actions × ${d.action_dim}; the arm executes the first `
      + `${Math.min(EXEC_HORIZON, d.action_horizon)} of each, then sends a new ${CAMERA}×${CAMERA} camera image, `
      + `state and instruction. An episode ends at the target or after ${MAX_STEPS} steps.`;
  }

  /** Local checks of the fields the page itself uses (the server checks the rest). */
  readForm() {
    const f = this.f;
    const int = (input, lo, hi, name, what) => {
      const v = Number(input.value);
      if (input.value === "" || !Number.isInteger(v) || v < lo || v > hi) {
        throw Object.assign(new Error(`${what} must be a whole number from ${lo} to ${hi}.`), { param: name });
      }
      return v;
    };
    const seed = int(f.seed.input, 0, MAX_SEED, "seed", "The episode seed");
    const rate = int(f.rate.input, 1, 1000, "rate", "The control rate");
    const steps = f.steps.input.value === "" ? undefined : Number(f.steps.input.value);
    return { model: f.model.input.value, seed, rate, steps };
  }

  async run() {
    if (this.running) return;
    this.errors.clear();
    let form;
    try {
      form = this.readForm();
    } catch (e) {
      return this.errors.show(e);
    }
    const run = (this.running = { socket: null, stopped: false });
    this.setOutcome("starting");
    this.runButton.disabled = true;
    this.stopButton.hidden = false;
    try {
      await this.episode(form, run);
    } catch (e) {
      if (run.stopped) {
        this.setOutcome(`stopped after ${this.sim?.steps ?? 0} steps`, "stopped");
      } else {
        if (e.needsKey) this.onAuthError(e);
        this.setOutcome("failed", "failed");
        this.showError(e);
      }
    } finally {
      run.socket?.close();
      this.running = null;
      this.runButton.disabled = false;
      const hadFocus = document.activeElement === this.stopButton;
      this.stopButton.hidden = true;
      if (hadFocus) this.runButton.focus(); // keep keyboard users on the form
    }
  }

  stop() {
    if (!this.running) return;
    this.running.stopped = true;
    this.running.socket?.close();
  }

  showError(e) {
    // the server's error frame names a field first ("num_inference_steps=0 is invalid: ...")
    const text = e.message.replace(/^The server stopped the episode: /, "");
    const param = e.param || Object.keys(PARAMS).find((p) => text.startsWith(`${p}=`) || text.startsWith(`${p}:`));
    const line = this.errors.show({ message: text, param });
    if (text !== e.message) line.textContent = `The server stopped the episode. ${line.textContent}`;
  }

  async episode(form, run) {
    // the policy must still be served (a 404 here says so in words) before the socket opens
    const details = (await this.api.json(`v1/models/${encodeURIComponent(form.model)}`)).details;
    if (details.kind !== "actions") {
      throw new RobotError(`${form.model} is not a robot policy (its kind is ${details.kind}).`);
    }
    const sim = new ReachSim(form.seed);
    this.begin(sim);
    this.setOutcome("connecting");
    run.socket = await PolicySocket.open(form.model, this.api.key);
    checkPolicy(form.model, run.socket.metadata);
    await run.socket.infer({ reset: true });
    const period = 1000 / form.rate;
    let next = performance.now();
    for (let cycle = 0; !sim.done && !run.stopped; cycle++) {
      this.setOutcome("waiting for the policy");
      const frame = { ...sim.observation(), seed: form.seed * 1000 + cycle }; // run_policy's seeds
      if (form.steps !== undefined) frame.num_inference_steps = form.steps;
      const sent = performance.now();
      const reply = await run.socket.infer(frame);
      const actions = reply.actions;
      if (!(actions instanceof NdArray) || actions.shape.length !== 2) {
        throw new RobotError("The server's reply holds no action chunk (an array of actions × dimensions).");
      }
      this.chunk(cycle, performance.now() - sent, reply);
      this.setOutcome("moving");
      for (let i = 0; i < Math.min(EXEC_HORIZON, actions.shape[0]) && !sim.done && !run.stopped; i++) {
        sim.step(actions.row(i));
        this.draw(sim);
        next += period;
        await sleep(next - performance.now());
      }
      next = performance.now(); // the arm waited for the chunk: pace from now
    }
    if (run.stopped) this.setOutcome(`stopped after ${sim.steps} steps`, "stopped");
    else if (sim.success) this.setOutcome(`reached the ${sim.goal} target in ${sim.steps} steps`, "done");
    else this.setOutcome(`timed out after ${sim.steps} steps (${sim.distance.toFixed(2)} from the target)`, "done");
  }

  begin(sim) {
    this.sim = sim;
    this.instruction.textContent = `Instruction: “${sim.instruction}”`;
    this.chunkList.replaceChildren();
    this.latencies = [];
    this.out.chunks.textContent = "0";
    for (const key of ["latency", "server"]) this.out[key].textContent = "–";
    this.draw(sim);
  }

  chunk(cycle, ms, reply) {
    const timing = reply.server_timing || {};
    this.latencies.push(ms);
    this.out.chunks.textContent = String(this.latencies.length);
    this.out.latency.textContent = `${ms.toFixed(0)} ms`;
    const server = typeof timing.infer_ms === "number" ? `${timing.infer_ms.toFixed(0)} ms` : "–";
    const queue = typeof timing.queue_ms === "number" ? `, queued ${timing.queue_ms.toFixed(0)} ms` : "";
    this.out.server.textContent = `${server}${queue}`;
    const deadline = { true: ", deadline met", false: ", deadline missed" }[timing.deadline_met] ?? "";
    const [h, d] = reply.actions.shape;
    this.chunkList.append(el("li", { text: `chunk ${cycle + 1}: ${h}×${d} actions, ${ms.toFixed(0)} ms round trip, `
      + `server ${server}${queue}${deadline}` }));
  }

  setOutcome(words, state = "running") {
    this.out.outcome.textContent = words;
    this.out.outcome.dataset.state = state;
  }

  draw(sim) {
    const o = this.out;
    o.steps.textContent = `${sim.steps} of ${sim.maxSteps}`;
    o.state.textContent = `${sim.pos[0].toFixed(3)}, ${sim.pos[1].toFixed(3)}`;
    o.distance.textContent = sim.distance.toFixed(3);
    drawArena(this.canvas, sim);
    this.canvas.setAttribute("aria-label", `The arena: targets ${Object.keys(sim.targets).join(", ")}; the arm at `
      + `(${o.state.textContent}), ${o.distance.textContent} from the ${sim.goal} target`);
  }
}

/** The policy's metadata frame must match what the simulated task provides. */
function checkPolicy(model, meta) {
  const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);
  const wrong = Object.entries(TASK).filter(([k, v]) => !same(meta[k], v));
  if (wrong.length) {
    const said = wrong.map(([k, v]) => `${k} ${JSON.stringify(meta[k])} (the task has ${JSON.stringify(v)})`);
    throw new RobotError(`The policy ${model} does not fit the simulated reaching task: ${said.join("; ")}.`);
  }
}

/** The camera image the policy sees, enlarged, with the arm's path and a ring around the goal. */
function drawArena(canvas, sim) {
  const camera = new OffscreenCanvas(CAMERA, CAMERA);
  const rgb = sim.render();
  const rgba = new Uint8ClampedArray(CAMERA * CAMERA * 4);
  for (let i = 0, j = 0; i < rgb.length; i += 3, j += 4) {
    rgba[j] = rgb[i];
    rgba[j + 1] = rgb[i + 1];
    rgba[j + 2] = rgb[i + 2];
    rgba[j + 3] = 255;
  }
  camera.getContext("2d").putImageData(new ImageData(rgba, CAMERA, CAMERA), 0, 0);
  const g = canvas.getContext("2d");
  const size = canvas.width;
  g.imageSmoothingEnabled = false;
  g.drawImage(camera, 0, 0, size, size);
  const at = ([x, y]) => [((x + 1) / 2) * size, ((1 - y) / 2) * size]; // y up in the arena
  g.lineWidth = 2;
  g.setLineDash([5, 4]);
  g.strokeStyle = `rgb(${COLOURS[sim.goal].join(",")})`;
  g.beginPath();
  const [gx, gy] = at(sim.goalPos);
  g.arc(gx, gy, ((TARGET_RADIUS + 0.06) / 2) * size, 0, 2 * Math.PI);
  g.stroke();
  g.setLineDash([]);
  g.strokeStyle = "rgba(245, 245, 245, 0.6)";
  g.beginPath();
  sim.path.forEach((p, i) => (i ? g.lineTo(...at(p)) : g.moveTo(...at(p))));
  g.stroke();
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, Math.max(0, ms)));
