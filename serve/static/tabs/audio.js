// The audio tab: one form per sort of audio model the server holds. Text-to-speech models (family
// "speech": POST /v1/audio/speech) get the speech form; every other audio family (Stable Audio:
// POST /v1/audio/generate) gets the sound form. A new sort of audio model adds a form module here.

import { el } from "../dom.js";
import { SoundForm } from "./_sound.js";
import { SpeechForm } from "./_speech.js";

const FORMS = { speech: SpeechForm }; // family (GET /v1/models/{id} details.family) -> its form
const OTHER = SoundForm; // families without an entry of their own

export default {
  kind: "audio",
  label: "Audio",
  mount(panel, ctx) {
    return mountForms(panel, ctx);
  },
};

async function mountForms(panel, { api, models, onAuthError }) {
  const note = el("p", { class: "note", role: "status", text: "Reading the audio models…" });
  panel.append(note);
  let described;
  try {
    described = await Promise.all(models.map(async (m) =>
      ({ ...m, details: (await api.json(`v1/models/${encodeURIComponent(m.id)}`)).details })));
  } catch (e) {
    if (e.needsKey) onAuthError(e);
    note.textContent = e.message;
    return;
  }
  note.remove();
  const groups = new Map(); // form class -> its models, in the server's order
  for (const m of described) {
    const Form = FORMS[m.details.family] || OTHER;
    groups.set(Form, [...(groups.get(Form) || []), m]);
  }
  for (const [Form, group] of groups) new Form(panel, { api, models: group, onAuthError });
}
