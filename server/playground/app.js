// The playground: generate, edit and video forms, each one request to this server's public
// API (the same calls as curl or the openai client), results as they stream, a live panel.

import { apiKey, listModels, modelLabel, setApiKey } from "./api.js";
import { MaskPainter, bitmapPNG } from "./mask.js";
import { LivePanel } from "./metrics.js";
import { ResultGroup } from "./results.js";
import { streamImages } from "./stream.js";
import { runVideo } from "./video.js";

const $ = (id) => document.getElementById(id);
const results = $("results");
const painter = new MaskPainter($("mask-canvas"));
// The edit's other images (multi-reference models), after the one shown and painted on.
let references = [];
// The served models as /v1/models lists them (ControlNets and IP-Adapters included).
let served = [];
const live = new LivePanel({
  waiting: $("stat-waiting"),
  running: $("stat-running"),
  forwards: $("stat-forwards"),
  mean: $("stat-mean"),
  recent: $("recent"),
  state: $("live-state"),
  note: $("live-note"),
});

/** An integer field's value, or undefined when it is empty (the model's default). */
function integer(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Math.trunc(Number(text));
}

// Seeds are 0 to 2^63-1, exact as BigInt (see api.js).
const SEEDS = 2n ** 63n;

function seed() {
  const text = $("seed").value.trim();
  return /^\d+$/.test(text) ? BigInt(text) : undefined;
}

/** The parameters panel as request fields; empty ones are left out, so the server's defaults apply. */
function parameters() {
  const guidance = $("guidance").value.trim();
  const fields = {
    model: $("model").value || undefined,
    size: $("size").value,
    num_inference_steps: integer("steps"),
    guidance_scale: guidance === "" ? undefined : Number(guidance),
    seed: seed(),
    negative_prompt: $("negative-prompt").value.trim() || undefined,
  };
  return Object.fromEntries(Object.entries(fields).filter(([, value]) => value !== undefined));
}

/** The fields of an image request (generation or edit), streamed. */
function imageFields(prompt) {
  return {
    ...parameters(),
    prompt,
    n: integer("n") ?? 1,
    stream: true,
    partial_images: Number($("partial-images").value),
  };
}

/** One streamed image request, shown in `group` as its events arrive. */
async function runImages(path, payload, group) {
  try {
    await streamImages(path, payload, {
      onPartial: (e) => group.preview(e.image_index, e.b64_json, e.output_format, e.partial_image_index),
      onCompleted: (e) =>
        group.complete(e.image_index, e.b64_json, e.output_format, `seed ${e.seed} · ${e.size}`),
    });
    group.done();
  } catch (error) {
    group.fail(error);
  }
}

/** A chosen file as a data URL, as the JSON fields `controlnet` and `ip_adapter` take images. */
function dataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

/** The control and reference image fields, where the model serves them and a file is chosen. */
async function conditioning() {
  const fields = {};
  const entries = [
    ["controlnet", "control-fields", "controlnet-name", "control-image", "control-scale"],
    ["ip_adapter", "reference-fields", "ip-adapter-name", "reference-image", "reference-scale"],
  ];
  for (const [field, box, name, image, scale] of entries) {
    const file = $(image).files[0];
    if ($(box).hidden || !file) continue;
    const entry = { name: $(name).value, image: await dataURL(file) };
    const text = $(scale).value.trim();
    if (text !== "") entry.scale = Number(text);
    if (field === "controlnet" && !$("control-mode-field").hidden) entry.mode = Number($("control-mode").value);
    fields[field] = [entry];
  }
  return fields;
}

async function generate(event) {
  event.preventDefault();
  const body = { ...imageFields($("generate-prompt").value), ...(await conditioning()) };
  const copies = Math.min(16, Math.max(1, integer("copies") ?? 1));
  // Independent requests sent together, as separate clients would: the server batches them.
  // With a seed, each takes the next free seeds (a request's n images use seed, seed+1, …).
  let group = null;
  const runs = [];
  for (let i = 0; i < copies; i++) {
    const json =
      body.seed === undefined ? body : { ...body, seed: (body.seed + BigInt(i * body.n)) % SEEDS };
    group = new ResultGroup(results, json.prompt, group);
    runs.push(runImages("v1/images/generations", { json }, group));
  }
  await Promise.all(runs);
}

async function edit(event) {
  event.preventDefault();
  if (!painter.image) return;
  const prompt = $("edit-prompt").value;
  const form = new FormData();
  if (references.length === 0) {
    form.append("image", await painter.imagePNG(), "image.png");
  } else {
    // Several images as `image[]` parts, in the order chosen (the one shown first).
    form.append("image[]", await painter.imagePNG(), "image-1.png");
    for (const [i, bitmap] of references.entries()) {
      form.append("image[]", await bitmapPNG(bitmap), `image-${i + 2}.png`);
    }
  }
  if (painter.painted) form.append("mask", await painter.maskPNG(), "mask.png");
  for (const [name, value] of Object.entries(imageFields(prompt))) form.append(name, String(value));
  // Image-to-image models only (the others refuse one): sent when set, else their default.
  const strength = $("strength").value.trim();
  if (strength !== "") form.append("strength", strength);
  await runImages("v1/images/edits", { form }, new ResultGroup(results, `Edit · ${prompt}`));
}

function createVideo(event) {
  event.preventDefault();
  const prompt = $("video-prompt").value;
  const body = { ...parameters(), prompt, seconds: Number($("seconds").value) };
  return runVideo(body, new ResultGroup(results, `Video · ${prompt}`));
}

/** The model select: served models, and each LoRA adapter under the model it adapts
 * (ControlNets and IP-Adapters are not models a request picks: the generate tab offers them). */
async function loadModels() {
  const select = $("model");
  try {
    const models = await listModels();
    served = models;
    const chosen = select.value;
    select.replaceChildren(...models.filter((m) => !m.parent).map((m) => new Option(modelLabel(m), m.id)));
    const loras = models.filter((m) => m.parent && !m.kind);
    for (const parent of new Set(loras.map((m) => m.parent))) {
      const group = document.createElement("optgroup");
      group.label = `LoRA adapters of ${parent}`;
      for (const adapter of loras.filter((m) => m.parent === parent)) {
        group.append(new Option(`${adapter.id} (LoRA of ${parent})`, adapter.id));
      }
      select.append(group);
    }
    if (chosen && [...select.options].some((option) => option.value === chosen)) select.value = chosen;
    showConditioning();
    $("connection").textContent = "";
  } catch (error) {
    $("connection").textContent = error.status === 401 ? "This server needs an API key." : error.message;
  }
}

/** The control and reference image fields, shown when the chosen model (a LoRA's base for a
 * LoRA) serves ControlNets or IP-Adapters, each select listing those it serves. */
function showConditioning() {
  const chosen = served.find((m) => m.id === $("model").value);
  const base = chosen?.parent ?? chosen?.id;
  for (const [kind, box, name] of [
    ["controlnet", "control-fields", "controlnet-name"],
    ["ip_adapter", "reference-fields", "ip-adapter-name"],
  ]) {
    const offered = served.filter((m) => m.kind === kind && m.parent === base);
    $(name).replaceChildren(...offered.map((m) => new Option(m.id, m.id)));
    $(box).hidden = offered.length === 0;
  }
  showControlModes();
}

/** The kind of control image, offered where the chosen ControlNet is a union one (its modes by
 * number, as a request's `mode` names them). */
function showControlModes() {
  const modes = served.find((m) => m.kind === "controlnet" && m.id === $("controlnet-name").value)?.modes;
  $("control-mode").replaceChildren(...(modes ?? []).map((mode, i) => new Option(`${i} · ${mode}`, i)));
  $("control-mode-field").hidden = !modes;
}

function showTab(name) {
  for (const tab of document.querySelectorAll("[role=tab]")) {
    tab.setAttribute("aria-selected", String(tab.dataset.tab === name));
  }
  for (const panel of document.querySelectorAll("[data-panel]")) panel.hidden = panel.dataset.panel !== name;
}

async function loadEditImage() {
  const files = [...$("edit-image").files];
  if (files.length === 0) return;
  try {
    const [first, ...others] = await Promise.all(files.map((file) => createImageBitmap(file)));
    painter.load(first);
    references = others;
    const { width, height } = painter.image;
    $("mask-hint").textContent =
      others.length === 0
        ? `${width}x${height}. Paint over the area to edit, or leave it unpainted to edit the whole image.`
        : `${files.length} images, sent in this order; the first (${width}x${height}) is shown.`;
  } catch {
    references = [];
    $("mask-hint").textContent = "The browser cannot read these files as images.";
  }
}

function wire() {
  const key = $("api-key");
  key.value = apiKey();
  // Stored on every keystroke, so a request never goes out with a stale key.
  key.addEventListener("input", () => setApiKey(key.value.trim()));
  key.addEventListener("change", () => {
    loadModels();
    live.refresh();
  });
  $("key-form").addEventListener("submit", (event) => event.preventDefault()); // Enter: `change` applies it
  for (const tab of document.querySelectorAll("[role=tab]")) {
    tab.addEventListener("click", () => showTab(tab.dataset.tab));
  }
  $("generate").addEventListener("submit", generate);
  $("model").addEventListener("change", showConditioning);
  $("controlnet-name").addEventListener("change", showControlModes);
  // An example prompt replaces what the prompt box holds.
  for (const example of document.querySelectorAll("#examples .example")) {
    example.addEventListener("click", () => ($("generate-prompt").value = example.textContent));
  }
  $("edit").addEventListener("submit", edit);
  $("video").addEventListener("submit", createVideo);
  $("edit-image").addEventListener("change", loadEditImage);
  $("brush").addEventListener("input", (e) => (painter.brushPercent = Number(e.target.value)));
  $("mask-clear").addEventListener("click", () => painter.clear());
  loadModels();
  live.start();
}

wire();
