// The reaching task of dit_core/zoo/reach_env.py, simulated in the page for the robot tab.
//
// What the policy sees is drawn and shaped exactly as ReachEnv does it, so its observations are
// in distribution: the 64x64 camera (dark floor, anti-aliased discs in the task's colours, the end
// effector white, y up in the arena and down in the image), the state [x, y, vx / VMAX, vy / VMAX]
// as float32, and an instruction in one of the task's phrasings. The dynamics are ReachEnv.step's
// (first-order velocity lag, position clipped to the arena, success within SUCCESS_RADIUS, at most
// MAX_STEPS steps). Only the layout of an episode differs: targets, goal, phrasing and start come
// from the page's own seeded generator, following ReachEnv.reset's rules but not its numbers.

import { NdArray } from "../msgpack.js";

export const COLOURS = { red: [225, 45, 45], green: [40, 190, 70], blue: [55, 100, 240], yellow: [235, 205, 35] };
export const PHRASINGS = ["reach the {} target", "go to the {} one", "move to {}", "touch the {} circle",
  "please move the arm to the {} target"];
export const NUM_TARGETS = 3;
export const TARGET_RADIUS = 0.12;
export const SUCCESS_RADIUS = 0.1;
export const EE_RADIUS = 0.06;
export const VMAX = 0.1;
export const LAG = 0.5;
export const MAX_STEPS = 50;
export const CAMERA = 64;
export const FLOOR = [40, 42, 48];
export const EE_COLOUR = [245, 245, 245];

/** A seeded generator of floats in [0, 1) (mulberry32: 32-bit state, plenty for layouts). */
export function generator(seed) {
  let s = seed >>> 0;
  return () => {
    s = (s + 0x6d2b79f5) >>> 0;
    let t = s;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const distance = (a, b) => Math.sqrt((a[0] - b[0]) * (a[0] - b[0]) + (a[1] - b[1]) * (a[1] - b[1]));
const clip = (x, lo, hi) => Math.min(Math.max(x, lo), hi);

/** Paint an anti-aliased disc (arena units) onto a float32 image [size, size, 3] in place, as
 * reach_env.draw_disc does (the same float64 arithmetic, stored to float32 at the same points). */
export function drawDisc(image, size, centre, radius, colour) {
  const scale = size / 2;
  const cx = (centre[0] + 1) * scale;
  const cy = (1 - centre[1]) * scale; // y up in the arena, down in the image
  const r = radius * scale;
  const x0 = Math.max(Math.trunc(cx - r - 1), 0);
  const x1 = Math.min(Math.trunc(cx + r + 2), size);
  const y0 = Math.max(Math.trunc(cy - r - 1), 0);
  const y1 = Math.min(Math.trunc(cy + r + 2), size);
  for (let y = y0; y < y1; y++) {
    const dy = y + 0.5 - cy;
    for (let x = x0; x < x1; x++) {
      const dx = x + 0.5 - cx;
      const alpha = clip(r - Math.sqrt(dx * dx + dy * dy) + 0.5, 0, 1);
      const at = (y * size + x) * 3;
      for (let c = 0; c < 3; c++) {
        image[at + c] = image[at + c] * (1 - alpha);
        image[at + c] = image[at + c] + alpha * colour[c];
      }
    }
  }
}

/** The camera image of a scene: ``targets`` {colour: [x, y]} in drawing order, the end effector at
 * ``pos``; uint8 [size * size * 3], rows top to bottom (ReachEnv.render). */
export function render(targets, pos, size = CAMERA) {
  const image = new Float32Array(size * size * 3);
  for (let i = 0; i < image.length; i++) image[i] = FLOOR[i % 3];
  for (const [colour, p] of Object.entries(targets)) drawDisc(image, size, p, TARGET_RADIUS, COLOURS[colour]);
  drawDisc(image, size, pos, EE_RADIUS, EE_COLOUR);
  const out = new Uint8Array(image.length);
  for (let i = 0; i < image.length; i++) out[i] = clip(Math.trunc(Math.fround(image[i] + 0.5)), 0, 255);
  return out;
}

/** One episode of the task. */
export class ReachSim {
  constructor(seed, maxSteps = MAX_STEPS) {
    this.maxSteps = maxSteps;
    const rand = generator(seed);
    const uniform = (lo, hi) => lo + (hi - lo) * rand();
    const colours = Object.keys(COLOURS);
    for (let i = colours.length - 1; i > 0; i--) { // a shuffle; the first NUM_TARGETS are the episode's
      const j = Math.floor(rand() * (i + 1));
      [colours[i], colours[j]] = [colours[j], colours[i]];
    }
    const placed = [];
    while (placed.length < NUM_TARGETS) {
      const p = [uniform(-0.75, 0.75), uniform(-0.75, 0.75)];
      if (placed.every((q) => distance(p, q) >= 0.4)) placed.push(p);
    }
    this.targets = Object.fromEntries(colours.slice(0, NUM_TARGETS).map((c, i) => [c, placed[i]]));
    this.goal = colours[Math.floor(rand() * NUM_TARGETS)];
    this.instruction = PHRASINGS[Math.floor(rand() * PHRASINGS.length)].replace("{}", this.goal);
    do {
      this.pos = [uniform(-0.85, 0.85), uniform(-0.85, 0.85)];
    } while (!placed.every((q) => distance(this.pos, q) >= 0.5));
    this.vel = [0, 0];
    this.steps = 0;
    this.path = [this.pos.slice()];
    this.success = false;
  }

  get goalPos() {
    return this.targets[this.goal];
  }

  get distance() {
    return distance(this.pos, this.goalPos);
  }

  get done() {
    return this.success || this.steps >= this.maxSteps;
  }

  /** Apply one velocity command [ax, ay] (ReachEnv.step's dynamics). */
  step(action) {
    const a = action.map((x) => clip(x, -1, 1));
    this.vel = this.vel.map((v, i) => v + LAG * (a[i] * VMAX - v));
    this.pos = this.pos.map((p, i) => clip(p + this.vel[i], -1, 1));
    this.steps += 1;
    this.success = this.distance < SUCCESS_RADIUS;
    this.path.push(this.pos.slice());
  }

  render() {
    return render(this.targets, this.pos);
  }

  state() {
    return Float32Array.from([this.pos[0], this.pos[1], this.vel[0] / VMAX, this.vel[1] / VMAX]);
  }

  /** The observation dict as ReachEnv gives it (openpi's key names). */
  observation() {
    return {
      "observation/image": NdArray.uint8(this.render(), [CAMERA, CAMERA, 3]),
      "observation/state": NdArray.float32(this.state(), [4]),
      prompt: this.instruction,
    };
  }
}
