// The live panel: /metrics read every second while the page is visible. It shows the queue
// (diffbatch_num_requests_waiting and _running) and the requests in each pipeline forward
// (the diffbatch_batch_size histogram), so a user sees requests batch together.

import { call } from "./api.js";

const INTERVAL_MS = 1000;
const RECENT_BARS = 40;
const SAMPLE = /^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/; // name{labels} value
const LABEL = /(\w+)="((?:[^"\\]|\\.)*)"/g;
const NOTE = "From /metrics, every second. Send several requests at once to see them share forwards.";

/** The samples of a Prometheus text exposition: [{name, labels, value}]. */
export function parsePrometheus(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    const match = SAMPLE.exec(line);
    if (!match) continue; // # HELP, # TYPE, blank lines
    const labels = {};
    for (const [, name, value] of (match[2] ?? "").matchAll(LABEL)) labels[name] = value;
    samples.push({ name: match[1], labels, value: number(match[3]) });
  }
  return samples;
}

function number(text) {
  return text === "+Inf" ? Infinity : text === "-Inf" ? -Infinity : Number(text);
}

function value(samples, name) {
  return samples.find((sample) => sample.name === name)?.value ?? 0;
}

/**
 * Forwards so far by size (requests in them), from the histogram's cumulative buckets:
 * Map(size -> {count, exact}); a bucket is exact where it holds one size (up to 16).
 */
function forwardsBySize(samples) {
  const buckets = samples
    .filter((sample) => sample.name === "diffbatch_batch_size_bucket")
    .map((sample) => [number(sample.labels.le), sample.value])
    .sort((a, b) => a[0] - b[0]);
  const counts = new Map();
  let below = 0;
  let bound = 0;
  for (const [size, cumulative] of buckets) {
    counts.set(size, { count: cumulative - below, exact: size - bound === 1 });
    below = cumulative;
    bound = size;
  }
  return counts;
}

export class LivePanel {
  /** `elements`: waiting, running, forwards, mean, recent, state, note. */
  constructor(elements) {
    this.elements = elements;
    this.counts = null; // forwards by size at the last scrape: new forwards are the difference
    this.recent = [];
    this.timer = null;
  }

  start() {
    document.addEventListener("visibilitychange", () => this.refresh());
    this.refresh();
  }

  /** Scrape now (the key changed, the page became visible), then every second. */
  refresh() {
    clearTimeout(this.timer);
    this.timer = null;
    if (document.visibilityState === "visible") this.timer = setTimeout(() => this.#scrape(), 0);
  }

  async #scrape() {
    this.timer = null;
    try {
      const text = await (await call("metrics")).text();
      this.#show(parsePrometheus(text));
      this.#state(true, NOTE);
    } catch (error) {
      this.#state(false, error.status === 401 ? "Enter the API key to see live metrics." : error.message);
    }
    if (this.timer === null && document.visibilityState === "visible") {
      this.timer = setTimeout(() => this.#scrape(), INTERVAL_MS);
    }
  }

  #show(samples) {
    const { waiting, running, forwards, mean } = this.elements;
    waiting.textContent = value(samples, "diffbatch_num_requests_waiting");
    running.textContent = value(samples, "diffbatch_num_requests_running");
    const count = value(samples, "diffbatch_batch_size_count");
    forwards.textContent = count;
    mean.textContent = count ? (value(samples, "diffbatch_batch_size_sum") / count).toFixed(2) : "–";
    this.#addRecent(forwardsBySize(samples));
  }

  /** The forwards since the last scrape become bars (within one second their order is unknown). */
  #addRecent(counts) {
    const previous = this.counts;
    this.counts = counts;
    if (previous === null) return;
    for (const [size, { count, exact }] of counts) {
      const added = count - (previous.get(size)?.count ?? 0);
      if (added < 0) return this.#resetRecent(); // the server restarted
      if (!Number.isFinite(size)) continue;
      for (let i = 0; i < Math.min(added, RECENT_BARS); i++) this.recent.push({ size, exact });
    }
    this.recent = this.recent.slice(-RECENT_BARS);
    this.#drawBars();
  }

  #resetRecent() {
    this.recent = [];
    this.#drawBars();
  }

  #drawBars() {
    const top = Math.max(4, ...this.recent.map((bar) => bar.size));
    const bars = this.recent.map(({ size, exact }) => {
      const bar = document.createElement("span");
      bar.style.height = `${(100 * size) / top}%`;
      bar.title = `${exact ? "" : "up to "}${size} request${size === 1 ? "" : "s"} in one forward`;
      bar.dataset.size = String(size);
      return bar;
    });
    this.elements.recent.replaceChildren(...bars);
  }

  #state(live, note) {
    this.elements.state.classList.toggle("on", live);
    this.elements.state.title = live ? "updating" : "not updating";
    this.elements.note.textContent = note;
  }
}
