"""What step mode's First-Block Cache must know of a transformer block class: which argument
and output are the image stream (and the block's other stream), and which arguments carry
one row per batch row, to be cut to the rows that compute (`first_block.CachedForward`).

diffusers' `TransformerBlockRegistry` says where a block returns its streams for the classes
its own cache hooks know; the blocks it lacks (HunyuanVideo 1.5's, LTX-2's, Qwen-Image 2.1's,
Chroma's, Ovis-Image's) and the per-row arguments (its hooks cut no rows) are written here, per class name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.hooks._helpers import TransformerBlockRegistry

# Per-row arguments of most diffusers blocks (FLUX, Qwen-Image, SD3, Wan, LTX); a dict's
# per-row tensors are cut (FLUX's `joint_attention_kwargs` carry the mask of a padded grid).
_COMMON = frozenset(
    {
        "hidden_states",
        "encoder_hidden_states",
        "temb",
        "encoder_hidden_states_mask",
        "attention_mask",
        "encoder_attention_mask",
        "joint_attention_kwargs",
    }
)


@dataclass(frozen=True)
class BlockArgs:
    """One block class's streams and per-row arguments."""

    # The image stream: the argument, and where the output has it (None: the output is it).
    hidden: str = "hidden_states"
    hidden_index: int | None = None
    # The other stream the block carries beside it (text, or LTX-2's audio), if any.
    second: str | None = None
    second_index: int | None = None
    # Whether the other stream outlives the last block (LTX-2's audio is a prediction too);
    # elsewhere it is text the transformer drops, so a skipping row needs no residual of it.
    second_kept: bool = False
    per_row: frozenset[str] = _COMMON
    # Per-row arguments with trailing rows every row shares after the batch's own (Qwen-Image
    # 2.1's modulation has an extra t=0 row that its text and references read).
    per_row_and_shared: frozenset[str] = frozenset()


_OWN: dict[str, BlockArgs] = {
    "Flux2TransformerBlock": BlockArgs(
        hidden_index=1,
        second="encoder_hidden_states",
        second_index=0,
        per_row=_COMMON | {"temb_mod_img", "temb_mod_txt"},
    ),
    "Flux2SingleTransformerBlock": BlockArgs(per_row=_COMMON | {"temb_mod"}),
    # Z-Image's main layers run on one sequence per row (image, then its caption), padded to
    # the longest row of the batch, with per-row rotary embeddings and masks.
    "ZImageTransformerBlock": BlockArgs(
        hidden="x",
        per_row=frozenset(
            {"x", "attn_mask", "freqs_cis", "adaln_input", "noise_mask", "adaln_noisy", "adaln_clean"}
        ),
    ),
    "HunyuanVideo15TransformerBlock": BlockArgs(
        hidden_index=0, second="encoder_hidden_states", second_index=1
    ),
    "QwenImage21TransformerBlock": BlockArgs(
        per_row=frozenset({"hidden_states", "attention_mask", "key_valid"}),
        per_row_and_shared=frozenset({"modulation"}),
    ),
    "LTX2VideoTransformerBlock": BlockArgs(
        hidden_index=0,
        second="audio_hidden_states",
        second_index=1,
        second_kept=True,
        per_row=frozenset(
            {
                "hidden_states",
                "audio_hidden_states",
                "encoder_hidden_states",
                "audio_encoder_hidden_states",
                "temb",
                "temb_audio",
                "temb_ca_scale_shift",
                "temb_ca_audio_scale_shift",
                "temb_ca_gate",
                "temb_ca_audio_gate",
                "temb_prompt",
                "temb_prompt_audio",
                "video_rotary_emb",
                "audio_rotary_emb",
                "ca_video_rotary_emb",
                "ca_audio_rotary_emb",
                "encoder_attention_mask",
                "audio_encoder_attention_mask",
                "self_attention_mask",
                "audio_self_attention_mask",
                "a2v_cross_attention_mask",
                "v2a_cross_attention_mask",
                "perturbation_mask",
            }
        ),
    ),
    # Chroma and Ovis-Image: FLUX's layout (Chroma's single blocks take text and image joined).
    "ChromaTransformerBlock": BlockArgs(hidden_index=1, second="encoder_hidden_states", second_index=0),
    "ChromaSingleTransformerBlock": BlockArgs(),
    "OvisImageTransformerBlock": BlockArgs(hidden_index=1, second="encoder_hidden_states", second_index=0),
    "OvisImageSingleTransformerBlock": BlockArgs(
        hidden_index=1, second="encoder_hidden_states", second_index=0
    ),
    # LTX's rotary embeddings are computed per row (from each row's coordinates).
    "LTXVideoTransformerBlock": BlockArgs(per_row=_COMMON | {"image_rotary_emb"}),
}


def block_args(block: torch.nn.Module) -> BlockArgs:
    """The block's streams and per-row arguments: ours where written, else diffusers' metadata
    with the common per-row names."""
    own = _OWN.get(type(block).__name__)
    if own is not None:
        return own
    try:
        metadata = TransformerBlockRegistry.get(type(block))
    except ValueError as missing:
        raise ValueError(
            f"first-block cache: no stream layout known for {type(block).__name__} "
            "(add it to pipelines/cache/block_args.py)"
        ) from missing
    text = metadata.return_encoder_hidden_states_index
    if text is None:
        return BlockArgs()
    return BlockArgs(
        hidden_index=metadata.return_hidden_states_index,
        second="encoder_hidden_states",
        second_index=text,
    )
