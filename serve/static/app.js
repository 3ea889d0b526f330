// The page: connect (asking for an API key when the server wants one), one tab per output kind the
// server's models make, and the live engine panel.

import { Api } from "./api.js";
import { EnginePanel } from "./panel.js";
import { Tabs } from "./tabs.js";

const $ = (id) => document.getElementById(id);
const api = new Api();
const panel = new EnginePanel(api, $("engine"));
const status = $("server-status");
let started = false;

function askForKey(err) {
  panel.stop();
  const form = $("key-form");
  form.hidden = false;
  $("key-error").textContent = api.key ? `The server refused this key: ${err.message}` : "";
  $("api-key").focus();
  status.textContent = "Waiting for an API key.";
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) {
    $("key-error").textContent = "Please enter the key the server was started with (--api-key).";
    return;
  }
  api.setKey(key);
  $("api-key").value = "";
  $("key-form").hidden = true;
  connect();
});

$("key-forget").addEventListener("click", () => {
  api.setKey("");
  $("key-forget").hidden = true;
  askForKey({ message: "" });
});

async function connect() {
  let models;
  try {
    models = (await api.json("v1/models")).data;
  } catch (e) {
    if (e.needsKey) return askForKey(e);
    status.textContent = e.message;
    return;
  }
  $("key-forget").hidden = !api.key;
  status.textContent = `Connected: ${models.length} model${models.length === 1 ? "" : "s"}.`;
  panel.start();
  if (started) return; // a new key after a refusal: the tabs are there already
  started = true;
  const tabs = new Tabs($("tablist"), $("panels"));
  const shipped = (document.body.dataset.tabs || "").split(",").filter(Boolean);
  const kinds = [...new Set(models.map((m) => m.kind))];
  for (const kind of kinds) {
    const ctx = { api, models: models.filter((m) => m.kind === kind), onAuthError: askForKey };
    await tabs.load(kind, ctx, shipped);
  }
}

connect();
