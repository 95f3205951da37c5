"""What a remix repeats of its source video: the create request's settings, kept as JSON on
the job (all but the prompt, with the seed it ran with), and whether it had an input image."""

from __future__ import annotations

import json

from server.errors import APIError
from server.jobs.model import VideoJob
from server.models import ServedModelList
from server.videos.protocol import VideoCreateRequest
from server.webhooks import SERVER_SIGNER, OwnWebhook


def remix_request(source: VideoJob, prompt: str) -> tuple[VideoCreateRequest, bool]:
    """The create request a remix of `source` makes with `prompt`, and whether it starts
    from the source's input image."""
    if source.status != "completed":
        raise APIError(
            400,
            f"video {source.id} is {source.status}; only a completed video can be remixed",
            param="video_id",
        )
    if source.settings is None:
        raise APIError(
            400,
            f"video {source.id} cannot be remixed: it was made before this server kept the "
            "settings remix needs",
            param="video_id",
        )
    settings = json.loads(source.settings)
    if settings.pop(_CONTROLLED, False):
        raise APIError(
            400,
            f"video {source.id} was made from a control video or reference images, which this server "
            "does not keep; create it again with them and the new prompt",
            param="video_id",
        )
    with_reference = bool(settings.pop(_WITH_REFERENCE, False))
    # The source's own webhook: a remix is another request.
    settings.pop("webhook_url", None)
    settings.pop(_WEBHOOK_SIGNER, None)
    return VideoCreateRequest.model_validate({**settings, "prompt": prompt}), with_reference


def check_still_served(models: ServedModelList, video_id: str, body: VideoCreateRequest) -> None:
    """A remix runs with its source's model and adapter; one this server no longer serves
    is the source video's fault, not a field the remix sent (400 naming `video_id`)."""
    try:
        models.lora_for(body.model, body.lora)
    except APIError as exc:
        if exc.status != 404:
            raise
        kind, name = (
            ("LoRA adapter", body.lora.name) if exc.param == "lora" and body.lora else ("model", body.model)
        )
        raise APIError(
            400,
            f"video {video_id} was made with the {kind} {name!r}, which is not served here "
            "now; it cannot be remixed",
            param="video_id",
        ) from None


# The key in a job's settings that says it had an input_reference (kept in its own file).
_WITH_REFERENCE = "input_reference"
# The key that says it had a controlled video's inputs (Wan VACE), which are not kept.
_CONTROLLED = "control_inputs"
# Who signs the events of its own webhook_url (`webhook_signer`: never a secret).
_WEBHOOK_SIGNER = "webhook_signer"


def settings_of(
    body: VideoCreateRequest,
    seed: int | None,
    with_reference: bool,
    controlled: bool = False,
    own_webhook: OwnWebhook | None = None,
) -> str:
    """What a remix of this job repeats: every setting but the prompt, with the seed it ran
    with (drawn by the engine when the request named none), and whether it started from an
    input image (the image itself is written beside the MP4). Its webhook_url and signer
    are kept too, for whichever server ends the job (`remix_request` drops them)."""
    settings = {**body.model_dump(exclude={"prompt"}, exclude_none=True), "seed": seed}
    if with_reference:
        settings[_WITH_REFERENCE] = True
    if controlled:
        settings[_CONTROLLED] = True
    if own_webhook is not None:
        settings[_WEBHOOK_SIGNER] = own_webhook.signer
    return json.dumps(settings)


def own_webhook_of(settings: str | None) -> OwnWebhook | None:
    """A job's own webhook from its kept settings (a job kept before signers were: the
    server signs, as it did then)."""
    kept = json.loads(settings) if settings else {}
    url = kept.get("webhook_url")
    return None if url is None else OwnWebhook(url, kept.get(_WEBHOOK_SIGNER, SERVER_SIGNER))
