"""Builder of `tiny-flux-kontext`: a FluxKontextPipeline with small random weights.

FLUX.1-Kontext [dev] is FLUX.1-dev's architecture unchanged (same transformer config, VAE, text
encoders): the reference image's latents are packed like the noise and appended to its tokens,
told apart only by their position ids (first axis 1 instead of 0). So the tiny model is
`tiny-flux`'s components under the Kontext pipeline class, with sharper image attention.

Kontext's call rescales the requested size to `max_area` (1024x1024 by default) and, with
`_auto_resize`, the reference image to one of its preferred ~1-megapixel resolutions; on this
VAE (2x, not 8x) that is 65,536 tokens each. Tiny calls pass `max_area=height*width` and
`_auto_resize=False` (the reference then keeps its own size, rounded to 4 pixels).
"""

from __future__ import annotations

from pathlib import Path

from diffusers import FluxKontextPipeline

from pipelines.tiny.flux import flux_components, flux_transformer

# Gains on the image tokens' attention keys and on the double-stream block's image attention
# output (`pipelines.tiny.gains`). With plain random weights two different reference images
# moved pixels by under 1/255 (0.0009), too little for a test to see a reference go to the
# wrong request; with a key gain of 10, by 3-7/255 (issue 47); with both, by about 26/255, and
# a negative prompt under true CFG by 13/255.
_IMAGE_KEY_GAIN = 20.0
_MIXING_GAIN = 6.0


def build_tiny_flux_kontext(directory: Path) -> None:
    """Build the pipeline with fixed seeds and save it to `directory`."""
    pipe = FluxKontextPipeline(
        **flux_components(flux_transformer(image_key_gain=_IMAGE_KEY_GAIN, mixing_gain=_MIXING_GAIN))
    )
    pipe.save_pretrained(directory, safe_serialization=True)
