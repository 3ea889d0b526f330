// The tab registry. A tab is one ES module, static/tabs/KIND.js, whose default export is
//   { kind: "image", label: "Image", mount(panel, ctx) }
// mount() builds the tab's content inside ``panel``; ctx = { api, models, onAuthError } where ``models`` are the
// server's models of that kind ({id, kind, ...} from /v1/models). The server lists the tab modules
// it ships in <body data-tabs>, so a new output kind needs a new module and nothing else. A tab
// made of several modules names its parts static/tabs/_PART.js: those are not tabs themselves.

import { el } from "./dom.js";

export class Tabs {
  constructor(tablist, panels) {
    this.tablist = tablist;
    this.panels = panels;
    this.tabs = [];
    tablist.addEventListener("keydown", (e) => this.onKey(e));
  }

  /** Load the module for ``kind`` when the server ships one, else show a note; then add its tab. */
  async load(kind, ctx, shipped) {
    if (!shipped.includes(kind)) {
      return this.add({ kind, label: kind }, (panel) =>
        panel.append(el("p", { class: "note", text: `This page has no ${kind} tab yet; use the HTTP API for ${kind} models.` })));
    }
    const tab = (await import(`./tabs/${kind}.js`)).default;
    return this.add(tab, (panel) => tab.mount(panel, ctx));
  }

  add(tab, mount) {
    const button = el("button", {
      type: "button", role: "tab", id: `tab-${tab.kind}`, "aria-controls": `panel-${tab.kind}`,
      "aria-selected": "false", tabindex: "-1", text: tab.label,
    });
    const panel = el("div", { role: "tabpanel", id: `panel-${tab.kind}`, "aria-labelledby": button.id, hidden: "" });
    button.addEventListener("click", () => this.select(this.tabs.findIndex((t) => t.button === button)));
    this.tablist.append(button);
    this.panels.append(panel);
    this.tabs.push({ button, panel });
    mount(panel);
    if (this.tabs.length === 1) this.select(0, false);
  }

  select(index, focus = true) {
    this.tabs.forEach(({ button, panel }, i) => {
      const on = i === index;
      button.setAttribute("aria-selected", String(on));
      button.tabIndex = on ? 0 : -1;
      panel.hidden = !on;
    });
    if (focus) this.tabs[index].button.focus();
  }

  // arrow keys, Home and End move between tabs (the WAI-ARIA tabs pattern)
  onKey(e) {
    const current = this.tabs.findIndex((t) => t.button === document.activeElement);
    if (current < 0) return;
    const n = this.tabs.length;
    const next = { ArrowRight: current + 1, ArrowLeft: current - 1 + n, Home: 0, End: n - 1 }[e.key];
    if (next === undefined) return;
    e.preventDefault();
    this.select(next % n);
  }
}
