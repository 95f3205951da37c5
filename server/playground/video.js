// Video jobs: create one (POST /v1/videos), poll it at the pace the server asks
// (openai-poll-after-ms), then download the MP4 and play it.

import { APIError, call } from "./api.js";

/** Runs one job from `body`, showing its progress and then the video in `group`. */
export async function runVideo(body, group) {
  try {
    let response = await call("v1/videos", { method: "POST", json: body });
    let job = await response.json();
    while (job.status === "queued" || job.status === "in_progress") {
      group.progress(job.progress, job.status);
      await sleep(pollAfterMs(response));
      response = await call(`v1/videos/${job.id}`);
      job = await response.json();
    }
    if (job.status === "failed") throw new APIError(job.error?.message ?? "the video job failed");
    // Fetched, not given to <video src>: a media element cannot send the key.
    const video = await (await call(`v1/videos/${job.id}/content`)).blob();
    group.video(URL.createObjectURL(video), `${job.size} · ${job.seconds} s`);
  } catch (error) {
    group.fail(error);
  }
}

function pollAfterMs(response) {
  const ms = Number(response.headers.get("openai-poll-after-ms"));
  return ms > 0 ? ms : 500;
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
