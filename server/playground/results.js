// Where results appear: one group per request, newest first, holding its images (previews
// replaced by the completed image), its video, or the server's error message.

export class ResultGroup {
  /** A new group at the top of `container`, or right after the group `after` (requests sent together). */
  constructor(container, title, after = null) {
    this.started = performance.now();
    this.previews = 0;
    this.element = element("article", "group");
    this.element.dataset.state = "running";
    this.element.dataset.previews = "0";
    const header = element("header");
    const heading = element("h3", "", title);
    heading.title = title;
    header.append(heading);
    this.meta = element("span", "meta", "Waiting for the server…");
    header.append(this.meta);
    this.grid = element("div", "grid");
    this.element.append(header, this.grid);
    this.figures = new Map();
    if (after) after.element.after(this.element);
    else container.prepend(this.element);
  }

  /** A preview of image `index` (partial_image event), shown until the image completes. */
  preview(index, b64, format, previewIndex) {
    const figure = this.#figure(index);
    if (figure.img.dataset.state === "done") return;
    figure.img.src = dataURL(b64, format);
    figure.img.dataset.state = "preview";
    figure.caption.textContent = `preview ${previewIndex + 1}`;
    this.previews += 1;
    this.element.dataset.previews = String(this.previews);
    this.meta.textContent = `Denoising… ${this.#previewText()}`;
  }

  /** The completed image `index`, with a link to save it. */
  complete(index, b64, format, caption) {
    const figure = this.#figure(index);
    const url = dataURL(b64, format);
    figure.img.src = url;
    figure.img.dataset.state = "done";
    const save = element("a", "save", "save");
    save.href = url;
    save.download = `diffbatch-${index}.${format}`;
    figure.caption.replaceChildren(`${caption} · `, save);
    this.meta.textContent = `Streaming… ${this.#previewText()}`;
  }

  /** A video job's progress (0–100) while it is queued or running. */
  progress(percent, status) {
    if (!this.bar) {
      this.bar = element("progress");
      this.bar.max = 100;
      this.grid.append(this.bar);
    }
    this.bar.value = percent;
    this.meta.textContent = `${status.replace("_", " ")} · ${percent}%`;
  }

  video(url, caption) {
    this.bar?.remove();
    const figure = element("figure", "shot video");
    const player = element("video");
    player.addEventListener("loadedmetadata", () =>
      player.classList.toggle("upscaled", player.videoWidth < player.clientWidth),
    );
    Object.assign(player, { src: url, controls: true, loop: true, autoplay: true, muted: true });
    player.playsInline = true;
    figure.append(player, element("figcaption", "", caption));
    this.grid.append(figure);
    this.done();
  }

  done() {
    this.element.dataset.state = "done";
    const seconds = ((performance.now() - this.started) / 1000).toFixed(1);
    this.meta.textContent = `Done in ${seconds} s`;
  }

  /** The server's message (an OpenAI error object, or an error event mid-stream). */
  fail(error) {
    this.element.dataset.state = "failed";
    this.bar?.remove();
    this.meta.textContent = error.status ? `Failed · HTTP ${error.status}` : "Failed";
    const message = element("p", "error", error.message);
    message.setAttribute("role", "alert");
    this.element.append(message);
  }

  #previewText() {
    return `${this.previews} preview${this.previews === 1 ? "" : "s"}`;
  }

  #figure(index) {
    let figure = this.figures.get(index);
    if (!figure) {
      const shot = element("figure", "shot");
      const img = element("img");
      img.alt = `image ${index + 1}`;
      // Small images (tiny models make 64x64) are scaled up in crisp pixels, large ones smoothly.
      img.addEventListener("load", () => img.classList.toggle("upscaled", img.naturalWidth < img.width));
      const caption = element("figcaption");
      shot.append(img, caption);
      shot.style.order = String(index); // in image order, whichever arrives first
      this.grid.append(shot);
      figure = { img, caption };
      this.figures.set(index, figure);
    }
    return figure;
  }
}

function element(tag, className = "", text = "") {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text) node.textContent = text;
  return node;
}

function dataURL(b64, format) {
  return `data:image/${format};base64,${b64}`;
}
