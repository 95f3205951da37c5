// Image streams: server-sent events read from a fetch() body. EventSource cannot POST a
// request body or send the key, so the stream is parsed here (the SSE format, minus ids and retry).

import { APIError, call, parseJSON } from "./api.js";

/** Yields {event, data} for each event of the response's body; comments (keep-alives) are skipped. */
export async function* serverSentEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replaceAll("\r\n", "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = parseEvent(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
      if (event) yield event;
    }
  }
}

function parseEvent(block) {
  let event = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") event = value;
    else if (field === "data") data.push(value);
  }
  return data.length ? { event, data: parseJSON(data.join("\n")) } : null;
}

/**
 * POSTs a streaming image request (JSON or a multipart form) and reports each image as it
 * comes: onPartial for each `*.partial_image` preview, onCompleted for each `*.completed`
 * image. An HTTP error, or an `error` event once the stream has begun, throws an APIError.
 */
export async function streamImages(path, { json, form }, { onPartial, onCompleted }) {
  const response = await call(path, { method: "POST", json, form });
  let completed = 0;
  for await (const { event, data } of serverSentEvents(response)) {
    if (event === "error") throw new APIError(data.error.message, 0, data.error.code);
    if (event.endsWith(".partial_image")) onPartial(data);
    else if (event.endsWith(".completed")) {
      completed += 1;
      onCompleted(data);
    }
  }
  if (!completed) throw new APIError("the stream ended before any image was done");
}
