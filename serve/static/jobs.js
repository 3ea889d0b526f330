// One card per request in flight: a progress bar, its state in words, a Cancel button, the outputs.
// Tabs of every output kind share it; a tab only decides what an output looks like.

import { el } from "./dom.js";
import { explain } from "./errors.js";

let counter = 0;

/** A request's card in ``list``. ``onCancel`` runs when the person presses Cancel. */
export class Job {
  constructor(list, title, onCancel) {
    this.id = ++counter;
    const titleId = `job-${this.id}-title`;
    this.state = el("span", { class: "job-state", role: "status", text: "waiting for the engine" });
    this.cancelButton = el("button", { type: "button", class: "job-cancel", text: "Cancel" });
    this.cancelButton.setAttribute("aria-label", `Cancel request ${this.id}`);
    this.cancelButton.addEventListener("click", () => onCancel());
    this.bar = el("progress", { max: "1", value: "0", "aria-labelledby": titleId });
    this.steps = el("span", { class: "job-steps", text: "" });
    this.outputs = el("div", { class: "job-outputs" });
    this.root = el(
      "li",
      { class: "job card", "data-state": "waiting", "aria-labelledby": titleId },
      el("div", { class: "job-head" }, el("span", { class: "job-title", id: titleId, text: `#${this.id} ${title}` }),
        this.state, this.cancelButton),
      el("div", { class: "job-progress" }, this.bar, this.steps),
      this.outputs,
    );
    list.prepend(this.root);
  }

  /** Show a request's event stream (from Api.stream) until it ends: "progress" events move the bar,
   * "error" fails the card, any other event is an output that ``render(event)`` turns into a node.
   * Resolves to the number of outputs shown. */
  async follow(events, render) {
    let shown = 0;
    try {
      for await (const event of events) {
        if (event.type === "progress") {
          this.progress(event.step, event.total);
        } else if (event.type === "error") {
          this.fail(explain(event.error));
          return shown;
        } else {
          this.output(render(event));
          shown += 1;
        }
      }
    } catch (e) {
      if (e.name === "AbortError") this.cancelled();
      else this.fail(e.message);
      return shown;
    }
    if (shown === 0) this.fail("The server closed the stream before any result arrived.");
    else this.done();
    return shown;
  }

  /** Move the bar to ``step`` of ``total``; ``text`` says it in words (default "step k of n"). */
  progress(step, total, text = `step ${step} of ${total}`) {
    this.bar.max = total;
    this.bar.value = step;
    this.steps.textContent = text;
    this.set("running", step < total ? "denoising" : "finishing");
  }

  /** Running with no measurable progress (an indeterminate bar); ``text`` says what is known. */
  busy(words, text = "") {
    this.bar.removeAttribute("value");
    if (this.steps.textContent !== text) this.steps.textContent = text;
    this.set("running", words);
  }

  output(node) {
    this.outputs.append(node);
  }

  done(text = "done") {
    if (!this.bar.hasAttribute("value")) this.bar.value = this.bar.max; // a finished bar is full
    this.end("done", text);
  }

  fail(message) {
    this.end("failed", "failed");
    this.outputs.append(el("p", { class: "job-error", role: "alert", text: message }));
  }

  /** Remove the card (the server refused the request: its error shows by the form instead). */
  discard() {
    this.root.remove();
  }

  cancelled() {
    this.end("cancelled", "cancelled");
  }

  set(state, words) {
    this.root.dataset.state = state;
    if (this.state.textContent !== words) this.state.textContent = words;
  }

  end(state, words) {
    this.set(state, words);
    const hadFocus = document.activeElement === this.cancelButton;
    this.cancelButton.remove();
    if (hadFocus) {
      this.root.tabIndex = -1; // keep keyboard users where they were
      this.root.focus();
    }
  }
}
