// The server's errors in words a person understands. The API answers {message, param, code}: a
// validator's wording ("prompt: String should have at least 1 character", "width=36 is invalid:
// expected a multiple of 8 ...") that names the field as the API spells it. explain() turns the
// field into a noun a person uses and the rule into a sentence; a message of any other shape (one
// the server already wrote for people) is kept, only made to read as a sentence.

// the API's field names -> what a person calls them
const NOUNS = {
  prompt: "prompt", negative_prompt: "negative prompt", input: "text", size: "size", width: "width",
  height: "height", num_inference_steps: "number of steps", guidance_scale: "guidance", true_cfg_scale: "guidance",
  seed: "seed", n: "number of images", num_outputs: "number of images", num_frames: "number of frames",
  fps: "frame rate", seconds: "length in seconds", voice: "voice", speed: "speed", model: "model", image: "image",
  mask: "mask", strength: "strength", lora: "LoRA adapter", steps: "number of steps", rate: "control rate",
};

// rules in the API's notation -> the same rule in words
const REWORD = [
  [/^(width|height) (?=an? |at |in |from )/, "a $1 that is "], // "size=...: expected width a multiple of 16"
  [/\b(?:an )?integer in \[(-?[\d.]+), (\d{16,})\]/g, "a whole number of at least $1"], // no useful upper end
  [/\b(?:an )?integer in \[(-?[\d.e+]+), (-?[\d.e+]+)\]/g, "a whole number from $1 to $2"],
  [/\b(a (?:finite )?number|a value|) ?in \[(-?[\d.e+]+), (-?[\d.e+]+)\]/g, (_, a, lo, hi) => `${a || "a number"} from ${lo} to ${hi}`],
  [/\b(a (?:finite )?number|) ?in \((-?[\d.e+]+), (-?[\d.e+]+)\]/g, (_, a, lo, hi) => `${a || "a number"} above ${lo} and at most ${hi}`],
  [/\ban integer\b/g, "a whole number"],
  [/ >= (-?[\d.e+]+)/g, " of at least $1"],
  [/ <= (-?[\d.e+]+)/g, " of at most $1"],
  [/\[((?:'[^']*'|"[^"]*"|-?[\d.]+)(?:, (?:'[^']*'|"[^"]*"|-?[\d.]+))*)\]/g, (_, items) => items.replace(/['"]/g, "")],
  [/\b(\d+)\.0\b(?!\.)/g, "$1"], // 0.0 -> 0
];

// pydantic's codes (RequestValidationError: "param: Input should ...") -> a sentence
const VALIDATOR = {
  string_too_short: (noun, m) => (/at least 1 character/.test(m) ? `Please fill in the ${noun}.`
    : `The ${noun} is too short: ${limit(m, "characters")}.`),
  string_too_long: (noun, m) => `The ${noun} is too long: use ${limit(m, "characters")}.`,
  too_short: (noun, m) => `The ${noun} has too few entries: ${limit(m, "items")}.`,
  too_long: (noun, m) => `The ${noun} has too many entries: ${limit(m, "items")}.`,
  missing: (noun) => `Please fill in the ${noun}.`,
  int_type: (noun) => `The ${noun} must be a whole number.`,
  int_parsing: (noun) => `The ${noun} must be a whole number.`,
  int_from_float: (noun) => `The ${noun} must be a whole number.`,
  float_type: (noun) => `The ${noun} must be a number.`,
  float_parsing: (noun) => `The ${noun} must be a number.`,
  finite_number: (noun) => `The ${noun} must be a finite number.`,
  greater_than: (noun, m) => `The ${noun} must be more than ${number(m)}.`,
  greater_than_equal: (noun, m) => `The ${noun} must be at least ${number(m)}.`,
  less_than: (noun, m) => `The ${noun} must be less than ${number(m)}.`,
  less_than_equal: (noun, m) => `The ${noun} must be at most ${number(m)}.`,
  string_pattern_mismatch: (noun) => `The ${noun} has characters or a form the server does not accept.`,
};

const number = (m) => (m.match(/(-?\d[\d.e+]*)\s*$/) || [, "the limit"])[1];
const limit = (m, unit) => {
  const [, how, n] = m.match(/(at least|at most) (\d+)/) || [];
  return how ? `${how} ${n} ${n === "1" ? unit.replace(/s$/, "") : unit}` : m;
};
const sentence = (text) => {
  const t = text.trim();
  if (!t) return t;
  return t[0].toUpperCase() + t.slice(1) + (/[.!?)]$/.test(t) ? "" : ".");
};

/** A noun for the API field ``param`` ("num_inference_steps" -> "number of steps"). */
export function noun(param) {
  if (!param) return "value";
  const last = String(param).split(".").filter((p) => !/^\d+$/.test(p)).pop();
  return NOUNS[param] || NOUNS[last] || String(last).replace(/_/g, " ");
}

/** The rule ``allowed`` (the API's "expected ..." text) in words. */
export function reword(allowed) {
  return REWORD.reduce((text, [pattern, to]) => text.replace(pattern, to), allowed);
}

/** A value as a person reads it: a Python repr's quotes become typographic ones. */
function shown(value) {
  const v = value.trim();
  const quoted = v.match(/^'(.*)'$/s) || v.match(/^"(.*)"$/s);
  if (quoted) return `“${quoted[1]}”`;
  return v.replace(/^(-?\d+)\.0$/, "$1");
}

/** The sentence to show for an error (an ApiError, or anything with ``message``, ``param``, ``code``). */
export function explain(err) {
  const message = String(err?.message ?? err ?? "");
  const param = err?.param || null;
  const what = noun(param);
  const byCode = err?.code && VALIDATOR[err.code];
  if (byCode && param) return byCode(what, message.replace(`${param}: `, ""));
  // dit_core.errors.InvalidParamError: "FIELD=VALUE is invalid: expected ALLOWED"
  const invalid = message.match(/^(.+?)=(.*) is invalid: expected (.*)$/s);
  if (invalid) {
    const [, field, value, allowed] = invalid;
    if (field === "height/width/num_outputs") {
      const tokens = value.match(/= (\d+) tokens/);
      const most = allowed.match(/at most \S*?(\d+) tokens/);
      return `This size and number of images ask for too much work at once (${tokens ? tokens[1] : value} tokens, `
        + `at most ${most ? most[1] : "the server's limit"}): choose a smaller size or fewer images.`;
    }
    return `The ${noun(param || field)} can't be ${shown(value)}: use ${reword(allowed)}${/[.)]$/.test(allowed) ? "" : "."}`;
  }
  if (param && message.startsWith(`${param}: `)) return sentence(`The ${what}: ${message.slice(param.length + 2)}`);
  // "queue_full: the queue is full ...": the code is for programs, the rest for people
  const coded = message.match(/^([a-z]+(?:_[a-z]+)+): (.+)$/s);
  if (coded && !(coded[1] in NOUNS)) return sentence(coded[2]);
  return sentence(message);
}
