// Labelled form fields with an error line each, and placing the server's errors next to the field
// they name. Shared by the tabs.

import { el } from "./dom.js";
import { explain } from "./errors.js";

/** A labelled control (``input`` or ``textarea``) with its error line; returns {wrap, input, error}. */
export function field(id, label, tag = "input", attrs = {}) {
  const input = el(tag, { id, name: id, ...attrs });
  const error = el("p", { class: "field-error", id: `${id}-error`, role: "alert" });
  input.setAttribute("aria-describedby", [attrs["aria-describedby"], error.id].filter(Boolean).join(" "));
  const wrap = el("div", { class: "field" }, el("label", { for: id, text: label }), input, error);
  return { wrap, input, error };
}

/** Error lines of one form, keyed by field; ``paramToField`` maps the server's ``param`` names. */
export class FormErrors {
  constructor(fields, general, paramToField) {
    this.fields = fields; // name -> {input, error, inputs?: {param: input}}
    this.general = general; // the error line for errors that name no field
    this.paramToField = paramToField;
  }

  clear() {
    for (const { input, inputs, error } of Object.values(this.fields)) {
      error.textContent = "";
      delete error.dataset.detail;
      for (const node of [input, ...Object.values(inputs || {})]) node?.removeAttribute("aria-invalid");
    }
    this.general.textContent = "";
    delete this.general.dataset.detail;
  }

  /** Show ``err`` (an ApiError) in words (errors.js) next to the field its ``param`` names, else under
   * the form. The server's own wording stays on the line's ``data-detail``. Returns the line. */
  show(err) {
    const name = this.paramToField[err.param] || err.param;
    const target = this.fields[name];
    const line = target ? target.error : this.general;
    line.textContent = explain(err);
    line.dataset.detail = err.message;
    if (!target) return line;
    // a field of several inputs (size: width and height) marks the one the server named: as the param, or
    // in the message ("size='36x32' is invalid: expected a width that is ...")
    const said = (k) => String(err.message).includes(`a ${k} that is`);
    const side = target.inputs && Object.keys(target.inputs).find(said);
    const input = (target.inputs && (target.inputs[err.param] || target.inputs[side])) || target.input;
    if (input) {
      input.setAttribute("aria-invalid", "true");
      input.focus();
    }
    return line;
  }
}

/** Run ``submit`` when ``form`` is submitted or Ctrl+Enter (Cmd+Enter) is pressed inside it. */
export function onSubmit(form, submit) {
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    submit();
  });
  form.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      submit();
    }
  });
}

/** Fill the ``select`` with ``options`` ([value, text] pairs), keeping its value when still offered. */
export function setOptions(select, options, preferred) {
  const keep = select.value;
  select.replaceChildren(...options.map(([value, text]) => el("option", { value, text })));
  const values = options.map(([value]) => String(value));
  const want = [keep, preferred].map((v) => (v === undefined || v === null ? "" : String(v)));
  select.value = want.find((v) => values.includes(v)) ?? values[0] ?? "";
}

/** Width x height inputs sharing one hint and one error line (ids ``{prefix}-width`` / ``-height``);
 * sets ``fields.size`` (the FormErrors entry: either input may be the one the server names). */
export function sizeFieldset(prefix, fields) {
  const hint = el("p", { class: "hint", id: `${prefix}-size-hint` });
  const error = el("p", { class: "field-error", id: `${prefix}-size-error`, role: "alert" });
  const side = (id, label) => {
    const input = el("input", { id, name: id, type: "number", inputmode: "numeric", "aria-describedby": `${hint.id} ${error.id}` });
    return [input, el("div", { class: "field" }, el("label", { for: id, text: label }), input)];
  };
  const [width, widthWrap] = side(`${prefix}-width`, "Width");
  const [height, heightWrap] = side(`${prefix}-height`, "Height");
  fields.size = { input: width, inputs: { width, height }, error, width, height, hint };
  return el("fieldset", { class: "size" }, el("legend", { text: "Size in pixels" }),
    el("div", { class: "row" }, widthWrap, el("span", { "aria-hidden": "true", text: "×" }), heightWrap), hint, error);
}

/** Fetch the chosen model's details (GET /v1/models/{id}) for a tab with ``api``, ``f`` (its
 * fields, with ``model`` and ``size``), ``errors`` and ``onAuthError``; set the size inputs to
 * the model's defaults and limits and return the details (undefined after an error, shown). */
export async function loadModelLimits(tab) {
  tab.errors.clear();
  let details;
  try {
    details = (await tab.api.json(`v1/models/${encodeURIComponent(tab.f.model.input.value)}`)).details;
  } catch (e) {
    if (e.needsKey) tab.onAuthError(e);
    tab.errors.show(e);
    return undefined;
  }
  const defaults = details.defaults || {};
  const { width, height, hint } = tab.f.size;
  for (const [input, value] of [[width, defaults.width], [height, defaults.height]]) {
    Object.assign(input, { value: value ?? "", min: details.size_multiple, step: details.size_multiple, max: details.max_side });
  }
  hint.textContent = `Multiples of ${details.size_multiple}, up to ${details.max_side}.`;
  return details;
}
