// The image tab's optional input image: a drop zone (a file input that also takes a dragged file), a
// mask brush (paint on a canvas over the image: painted pixels are repainted, the rest kept) and a
// strength slider. With an image the tab calls POST /v1/images/edits; the mask goes out as OpenAI
// defines it: a PNG of the image's size whose fully transparent pixels mark where to edit.

import { el } from "../dom.js";

const MAX_CANVAS = 512; // the brush canvas's longest side (a larger image is painted on a scaled copy)
const SHOWN_PX = 256; // small pictures are shown enlarged (pixelated) to about this size
const TYPES = "image/png,image/jpeg,image/webp,image/gif,image/bmp";
const PAINT = "#ff3030"; // the brush's colour (the mask canvas is shown half transparent over the picture)

export class ImageInput {
  /** ``onImage(width, height)`` runs when an image is loaded (its natural size), ``onImage()`` when removed. */
  constructor(onImage) {
    this.onImage = onImage;
    this.picture = null; // the loaded <img>
    this.painted = false;
    this.file = el("input", { id: "image-input", name: "image-input", type: "file", accept: TYPES,
      "aria-describedby": "image-input-hint image-input-error" });
    this.file.addEventListener("change", () => this.file.files[0] && this.load(this.file.files[0]));
    this.error = el("p", { class: "field-error", id: "image-input-error", role: "alert" });
    this.hint = el("p", { class: "hint", id: "image-input-hint",
      text: "Drop an image here or choose a file to change it instead of starting from noise." });
    this.drop = el("div", { class: "dropzone", id: "image-drop" },
      el("label", { for: this.file.id, text: "Image file" }), this.file, this.hint);
    for (const type of ["dragenter", "dragover"]) {
      this.drop.addEventListener(type, (e) => {
        e.preventDefault();
        this.drop.dataset.over = "";
      });
    }
    this.drop.addEventListener("dragleave", () => delete this.drop.dataset.over);
    this.drop.addEventListener("drop", (e) => {
      e.preventDefault();
      delete this.drop.dataset.over;
      const file = [...(e.dataTransfer?.files || [])].find((f) => f.type.startsWith("image/"));
      if (file) this.load(file);
      else this.error.textContent = "That is not an image file: drop a PNG, JPEG or WebP picture.";
    });

    this.source = el("canvas", { id: "image-source", class: "paint-source", "aria-hidden": "true" });
    this.mask = el("canvas", { id: "image-mask", class: "paint-mask", role: "img",
      "aria-label": "Mask: paint over the image where it should change; unpainted parts are kept",
      "aria-describedby": "image-mask-hint" });
    // the brush's diameter in screen pixels
    this.brush = el("input", { id: "image-brush", name: "image-brush", type: "range", min: "4", max: "64", value: "24" });
    this.strength = el("input", { id: "image-strength", name: "image-strength", type: "range", min: "0.05", max: "1",
      step: "0.05", value: "0.6", "aria-describedby": "image-strength-hint image-strength-error" });
    this.strengthShown = el("output", { for: this.strength.id, id: "image-strength-value", text: "0.60" });
    this.strength.addEventListener("input", () => (this.strengthShown.textContent = Number(this.strength.value).toFixed(2)));
    this.strengthError = el("p", { class: "field-error", id: "image-strength-error", role: "alert" });
    const button = (text, onClick) => {
      const b = el("button", { type: "button", text });
      b.addEventListener("click", onClick);
      return b;
    };
    this.maskHint = el("p", { class: "hint", id: "image-mask-hint",
      text: "Paint with the mouse (or a finger) where the image should change. No paint: the whole image changes." });
    this.maskTools = el("div", { class: "row mask-tools" },
      el("div", { class: "field" }, el("label", { for: this.brush.id, text: "Brush size" }), this.brush),
      button("Clear mask", () => this.clearMask()), button("Paint everything", () => this.fillMask()));
    this.editor = el("div", { class: "image-editor", hidden: "" },
      el("div", { class: "paint" }, this.source, this.mask), this.maskHint, this.maskTools,
      el("div", { class: "field" },
        el("label", { for: this.strength.id }, "Strength ", this.strengthShown), this.strength,
        el("p", { class: "hint", id: "image-strength-hint",
          text: "How much changes: low keeps the picture, 1 redraws it from the prompt." }), this.strengthError),
      button("Remove image", () => this.remove()));
    this.root = el("fieldset", { class: "image-input" }, el("legend", { text: "Start from an image (optional)" }), this.drop,
      this.error, this.editor);
    this.paintEvents();
  }

  /** Offer what the chosen model accepts (``inputs`` of GET /v1/models/{id}: "image", "mask"). */
  setInputs(inputs = []) {
    const image = inputs.includes("image");
    this.file.disabled = !image;
    this.hint.textContent = image
      ? "Drop an image here or choose a file to change it instead of starting from noise."
      : "This model makes images from text only.";
    this.maskable = inputs.includes("mask");
    this.mask.hidden = !this.maskable;
    this.maskTools.hidden = this.maskHint.hidden = !this.maskable;
    if (!image) this.remove();
  }

  get loaded() {
    return this.picture !== null;
  }

  async load(file) {
    this.error.textContent = "";
    const url = URL.createObjectURL(file);
    const img = new Image();
    try {
      img.src = url;
      await img.decode();
    } catch {
      URL.revokeObjectURL(url);
      this.error.textContent = `${file.name || "This file"} could not be read as an image: choose a PNG, JPEG or WebP file.`;
      return;
    }
    this.picture = img;
    const scale = Math.min(1, MAX_CANVAS / Math.max(img.naturalWidth, img.naturalHeight));
    const w = Math.max(1, Math.round(img.naturalWidth * scale));
    const h = Math.max(1, Math.round(img.naturalHeight * scale));
    for (const c of [this.source, this.mask]) Object.assign(c, { width: w, height: h });
    const k = Math.max(1, Math.floor(SHOWN_PX / Math.max(w, h))); // small pictures enlarged by a whole factor
    for (const c of [this.source, this.mask]) Object.assign(c.style, { width: `${w * k}px`, height: `${h * k}px` });
    const ctx = this.source.getContext("2d");
    ctx.imageSmoothingEnabled = scale < 1;
    ctx.drawImage(img, 0, 0, w, h);
    this.clearMask();
    this.editor.hidden = false;
    this.drop.dataset.loaded = "";
    this.hint.textContent = `${file.name || "image"}: ${img.naturalWidth}×${img.naturalHeight}. Drop or choose another to replace it.`;
    this.onImage(img.naturalWidth, img.naturalHeight);
  }

  remove() {
    if (!this.picture) return;
    URL.revokeObjectURL(this.picture.src);
    this.picture = null;
    this.file.value = "";
    this.editor.hidden = true;
    delete this.drop.dataset.loaded;
    this.hint.textContent = "Drop an image here or choose a file to change it instead of starting from noise.";
    this.onImage();
  }

  clearMask() {
    this.mask.getContext("2d").clearRect(0, 0, this.mask.width, this.mask.height);
    this.painted = false;
  }

  fillMask() {
    const ctx = this.mask.getContext("2d");
    ctx.fillStyle = PAINT;
    ctx.fillRect(0, 0, this.mask.width, this.mask.height);
    this.painted = true;
  }

  paintEvents() {
    let last = null;
    const at = (e) => {
      const box = this.mask.getBoundingClientRect();
      return [(e.clientX - box.left) * this.mask.width / box.width, (e.clientY - box.top) * this.mask.height / box.height];
    };
    // whole canvas pixels, no anti-aliasing: what is shown painted is exactly what the mask marks
    const dab = (ctx, [cx, cy], r) => {
      ctx.fillRect(Math.floor(cx), Math.floor(cy), 1, 1); // the pixel under the pointer, whatever the size
      for (let y = Math.floor(cy - r); y <= Math.ceil(cy + r); y++) {
        for (let x = Math.floor(cx - r); x <= Math.ceil(cx + r); x++) {
          if ((x + 0.5 - cx) ** 2 + (y + 0.5 - cy) ** 2 <= r * r) ctx.fillRect(x, y, 1, 1);
        }
      }
    };
    const stroke = (from, to) => {
      const ctx = this.mask.getContext("2d");
      ctx.fillStyle = PAINT;
      const r = Number(this.brush.value) * this.mask.width / this.mask.getBoundingClientRect().width / 2;
      const n = Math.max(1, Math.ceil(Math.hypot(to[0] - from[0], to[1] - from[1]) / Math.max(0.5, r / 2)));
      for (let i = 0; i <= n; i++) dab(ctx, [from[0] + (to[0] - from[0]) * i / n, from[1] + (to[1] - from[1]) * i / n], r);
      this.painted = true;
    };
    this.mask.addEventListener("pointerdown", (e) => {
      e.preventDefault();
      this.mask.setPointerCapture?.(e.pointerId);
      last = at(e);
      stroke(last, last);
    });
    this.mask.addEventListener("pointermove", (e) => {
      if (last === null) return;
      const p = at(e);
      stroke(last, p);
      last = p;
    });
    for (const type of ["pointerup", "pointercancel"]) this.mask.addEventListener(type, () => (last = null));
  }

  /** The image and mask to send, at ``width`` x ``height``: {image: PNG Blob, mask: PNG Blob or null}.
   * The mask is opaque where the picture is kept and fully transparent where it was painted. */
  async files(width, height) {
    const image = canvas(width, height);
    const ctx = image.getContext("2d");
    ctx.imageSmoothingQuality = "high";
    ctx.drawImage(this.picture, 0, 0, width, height);
    let mask = null;
    if (this.maskable && this.painted) {
      const scaled = canvas(width, height);
      const sctx = scaled.getContext("2d");
      sctx.imageSmoothingEnabled = false; // a painted pixel stays painted, none half
      sctx.drawImage(this.mask, 0, 0, width, height);
      const paint = sctx.getImageData(0, 0, width, height);
      const out = new ImageData(width, height);
      for (let i = 3; i < out.data.length; i += 4) out.data[i] = paint.data[i] >= 128 ? 0 : 255;
      sctx.clearRect(0, 0, width, height);
      sctx.putImageData(out, 0, 0);
      mask = await png(scaled);
    }
    return { image: await png(image), mask };
  }
}

function canvas(width, height) {
  return Object.assign(document.createElement("canvas"), { width, height });
}

function png(c) {
  return new Promise((resolve, reject) => c.toBlob((b) => (b ? resolve(b) : reject(new Error("The picture could not be encoded."))), "image/png"));
}
