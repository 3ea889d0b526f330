// The live engine panel: polls GET /v1/engine/stats and shows what the engine is doing.

const POLL_MS = 400;
const CHART_STEPS = 60;

const percent = (x) => (x === null || x === undefined ? "–" : `${Math.round(x * 100)}%`);

export class EnginePanel {
  constructor(api, root) {
    this.api = api;
    this.root = root;
    this.timer = null;
    this.field = (name) => root.querySelector(`#stat-${name}`);
    document.addEventListener("visibilitychange", () => (document.hidden ? this.stop() : this.start()));
  }

  start() {
    if (this.timer === null) this.timer = setTimeout(() => this.poll(), 0);
  }

  stop() {
    clearTimeout(this.timer);
    this.timer = null;
  }

  async poll() {
    try {
      this.show(await this.api.json("v1/engine/stats"));
      this.root.removeAttribute("data-error");
    } catch (e) {
      this.root.dataset.error = e.message;
      if (e.needsKey) return this.stop(); // started again once a key is given
    }
    if (this.timer !== null) this.timer = setTimeout(() => this.poll(), POLL_MS);
  }

  show(s) {
    const set = (name, text) => {
      const node = this.field(name);
      if (node.textContent !== String(text)) node.textContent = text;
    };
    set("batch", s.steps.batch_size);
    set("batch-peak", s.steps.max_batch_size);
    this.root.querySelectorAll(".stat-window").forEach((n) => (n.textContent = s.steps.window_s));
    set("queue", `${s.queue.waiting} / ${s.queue.running}`);
    set("rate", s.steps.per_second.toFixed(1));
    set("step-ms", s.steps.last_ms === null ? "–" : `${s.steps.last_ms.toFixed(0)} ms`);
    const sc = s.step_cache;
    set("step-cache", sc.mode === "none" ? "off" : `${sc.mode}: ${sc.rows_skipped} of ${sc.rows} rows skipped (${percent(sc.skip_rate)})`);
    const pc = s.prompt_cache;
    set("prompt-cache", pc === null ? "off" : `${percent(pc.hit_rate)} (${pc.hits} hits, ${pc.misses} misses)`);
    set("requests", `${s.requests.finished} / ${s.requests.aborted} / ${s.requests.failed}`);
    this.chart(s.steps.recent.slice(-CHART_STEPS));
  }

  chart(steps) {
    const box = this.field("chart");
    const peak = Math.max(1, ...steps.map((st) => st.batch_size));
    const bars = steps.map((st) => {
      const bar = document.createElement("span");
      bar.style.height = `${(100 * st.batch_size) / peak}%`;
      bar.title = `${st.batch_size} request(s), ${st.ms.toFixed(0)} ms`;
      bar.dataset.batch = st.batch_size;
      return bar;
    });
    box.replaceChildren(...bars);
  }
}
