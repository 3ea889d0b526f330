// The image tab's LoRA picker: the adapters the server holds for the chosen model (GET /v1/loras),
// one chosen with its scale, sent as the request's ``lora`` field ([{"name", "scale"}]). Hidden when
// the server has no adapter for the model (or no /v1/loras route); listed again whenever it is opened,
// since adapters load and unload while the server runs.

import { el } from "../dom.js";
import { field, setOptions } from "../form.js";

export class LoraPicker {
  constructor(api) {
    this.api = api;
    this.model = null;
    this.pick = field("image-lora", "LoRA adapter", "select", { "aria-describedby": "image-lora-hint" });
    this.scale = field("image-lora-scale", "Adapter scale", "input",
      { type: "number", inputmode: "decimal", step: "0.1", value: "1" });
    this.hint = el("p", { class: "hint", id: "image-lora-hint" });
    this.pick.wrap.insertBefore(this.hint, this.pick.error);
    this.pick.input.addEventListener("focus", () => this.refresh());
    this.pick.input.addEventListener("change", () => this.showScale());
    this.root = el("div", { class: "row lora", hidden: "" }, this.pick.wrap, this.scale.wrap);
  }

  /** List the adapters for ``model`` (the chosen one when omitted); hides the picker when there are none. */
  async refresh(model = this.model) {
    this.model = model;
    let adapters = [];
    try {
      adapters = (await this.api.json("v1/loras")).data.filter((a) => a.model === model);
    } catch {
      adapters = []; // a server without adapters (or without the route): nothing to pick
    }
    if (model !== this.model) return; // another model was chosen meanwhile
    setOptions(this.pick.input, [["", "none"], ...adapters.map((a) => [a.name, `${a.name} (rank ${a.rank})`])]);
    this.root.hidden = adapters.length === 0;
    this.hint.textContent = adapters.length
      ? `Adapters loaded for ${model}; a scale of 0 is the model without it.` : "";
    this.showScale();
  }

  showScale() {
    this.scale.wrap.hidden = !this.pick.input.value;
  }

  /** The request's ``lora`` field, or undefined with none chosen. */
  value() {
    const name = this.pick.input.value;
    if (this.root.hidden || !name) return undefined;
    const scale = this.scale.input.value === "" ? 1 : Number(this.scale.input.value);
    return [{ name, scale }];
  }
}
