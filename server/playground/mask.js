// The edit mask, painted with a brush over the uploaded image. On the wire it has OpenAI's
// meaning: a PNG the size of the image, fully transparent (alpha 0) where painted = the area
// to edit, opaque elsewhere.

export class MaskPainter {
  constructor(canvas) {
    this.canvas = canvas;
    this.image = null;
    // The strokes, at the image's own size, kept apart from the view so the mask is exact.
    this.strokes = document.createElement("canvas");
    this.tint = document.createElement("canvas"); // the strokes recoloured, for the view
    this.painted = false;
    this.brushPercent = 6;
    this.last = null;
    canvas.addEventListener("pointerdown", (e) => this.#start(e));
    canvas.addEventListener("pointermove", (e) => this.#move(e));
    for (const type of ["pointerup", "pointercancel", "pointerleave"]) {
      canvas.addEventListener(type, () => (this.last = null));
    }
  }

  /** Show `bitmap` (an ImageBitmap) and start a fresh mask of its size. */
  load(bitmap) {
    this.image = bitmap;
    for (const c of [this.canvas, this.strokes, this.tint]) {
      c.width = bitmap.width;
      c.height = bitmap.height;
    }
    // A small image is scaled up in crisp pixels, a large one down smoothly.
    this.canvas.classList.toggle("upscaled", bitmap.width < this.canvas.clientWidth);
    this.clear();
  }

  clear() {
    this.strokes.getContext("2d").clearRect(0, 0, this.strokes.width, this.strokes.height);
    this.painted = false;
    this.#render();
  }

  /** The image exactly as shown and painted on (the browser applies EXIF rotation; the server does not). */
  imagePNG() {
    const canvas = this.#blank();
    canvas.getContext("2d").drawImage(this.image, 0, 0);
    return toPNG(canvas);
  }

  /** The mask: opaque everywhere, cleared (alpha 0) where painted. */
  maskPNG() {
    const canvas = this.#blank();
    const context = canvas.getContext("2d");
    context.fillStyle = "#000";
    context.fillRect(0, 0, canvas.width, canvas.height);
    context.globalCompositeOperation = "destination-out";
    context.drawImage(this.strokes, 0, 0);
    return toPNG(canvas);
  }

  #blank() {
    const canvas = document.createElement("canvas");
    canvas.width = this.image.width;
    canvas.height = this.image.height;
    return canvas;
  }

  #start(event) {
    if (!this.image) return;
    this.canvas.setPointerCapture(event.pointerId);
    this.last = this.#point(event);
    this.#paint(this.last, this.last);
  }

  #move(event) {
    if (!this.last) return;
    const point = this.#point(event);
    this.#paint(this.last, point);
    this.last = point;
  }

  /** The pointer in image pixels (the canvas is scaled by CSS). */
  #point(event) {
    const box = this.canvas.getBoundingClientRect();
    return {
      x: ((event.clientX - box.left) * this.canvas.width) / box.width,
      y: ((event.clientY - box.top) * this.canvas.height) / box.height,
    };
  }

  #paint(from, to) {
    const context = this.strokes.getContext("2d");
    // The brush is a share of the image's longer side, so it feels the same on any image.
    const side = Math.max(this.image.width, this.image.height);
    context.lineWidth = Math.max(1, (side * this.brushPercent) / 100);
    context.lineCap = "round";
    context.strokeStyle = "#000";
    context.beginPath();
    context.moveTo(from.x, from.y);
    context.lineTo(to.x, to.y);
    context.stroke();
    this.painted = true;
    this.#render();
  }

  #render() {
    if (!this.image) return;
    const context = this.canvas.getContext("2d");
    context.clearRect(0, 0, this.canvas.width, this.canvas.height);
    context.drawImage(this.image, 0, 0);
    // The painted area shows as a translucent tint: the strokes recoloured, laid over the image.
    const tint = this.tint.getContext("2d");
    tint.globalCompositeOperation = "copy";
    tint.drawImage(this.strokes, 0, 0);
    tint.globalCompositeOperation = "source-in";
    tint.fillStyle = "#ff3d6e";
    tint.fillRect(0, 0, this.tint.width, this.tint.height);
    context.globalAlpha = 0.55;
    context.drawImage(this.tint, 0, 0);
    context.globalAlpha = 1;
  }
}

/** `bitmap` (an ImageBitmap) as a PNG, as the browser shows it (EXIF rotation applied). */
export function bitmapPNG(bitmap) {
  const canvas = document.createElement("canvas");
  canvas.width = bitmap.width;
  canvas.height = bitmap.height;
  canvas.getContext("2d").drawImage(bitmap, 0, 0);
  return toPNG(canvas);
}

function toPNG(canvas) {
  return new Promise((resolve) => canvas.toBlob(resolve, "image/png"));
}
