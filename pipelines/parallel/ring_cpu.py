"""Ring attention on the CPU (`--sequence-parallel N --sp-mode ring --device cpu`): the
attention of one key/value share that also returns its log-sum-exp, which diffusers' ring
needs to merge the shares and its native backend does not give.

diffusers 0.42.1's `TemplatedRingAttention` runs the backend's forward op once per device's
keys and values, each time with `return_lse=True`, and merges the partial outputs by their
log-sum-exp (out (B, S, H, D), lse (B, S, H)). The backends whose ops return it (cudnn,
flash, sage) are CUDA kernels; the native backend's op (`_native_attention_forward_op`, the
one the CPU runs) raises on `return_lse`. `attention_with_lse` is that op: the kernel
torch's `scaled_dot_product_attention` itself runs on the CPU (its flash attention,
`aten._scaled_dot_product_flash_attention_for_cpu`), which returns the log-sum-exp beside
the output (a first version materialised the scores in plain torch: 3.5x slower a request
at 512x512), and `install` puts it in the op's place in `diffusers.models.attention_dispatch`
for the life of a ring lane's member on the CPU (`pipelines.parallel.sequence.split_tokens`), as
`sequence._one_mask_for_all_heads` swaps LTX's dispatch for a member's life. Every call
without `return_lse` (Ulysses, one device) goes to diffusers' own op unchanged.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

_INSTALLED = "returns_lse_on_cpu"


def attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention of `query` over `key` and `value`, all (B, S, H, D) as diffusers lays
    them out, and its log-sum-exp: out (B, S, H, D), lse (B, S, H). `attn_mask` as
    `scaled_dot_product_attention` takes it, broadcast to (B, H, S, keys): True (or an added
    0) where a key is seen."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # the kernel adds its mask
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=attn_mask.device).masked_fill(
            ~attn_mask, float("-inf")
        )
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, attn_mask=attn_mask, scale=scale
    )
    return out.transpose(1, 2), lse.transpose(1, 2)


def install() -> None:
    """Have diffusers' native backend return the log-sum-exp where its ring asks for it, in
    this process from now on (a lane's member splits tokens for its life); once."""
    from diffusers.models import attention_dispatch

    native = attention_dispatch._native_attention_forward_op
    if getattr(native, _INSTALLED, False):
        return
    # diffusers calls its op positionally (ctx, query, key, value, attn_mask, dropout_p,
    # is_causal, scale, enable_gqa, return_lse, *, _save_ctx, _parallel_config).
    signature = inspect.signature(native)

    def forward_op(*args: Any, **kwargs: Any) -> Any:
        given = signature.bind(*args, **kwargs)
        given.apply_defaults()
        call = given.arguments
        if not call["return_lse"]:
            return native(*args, **kwargs)
        # `_templated_context_parallel_attention` already refuses causal and GQA attention;
        # dropout is 0 in inference, and no backward runs (the autograd context goes unused).
        if call["dropout_p"] or call["is_causal"] or call["enable_gqa"]:
            raise ValueError("the CPU's ring attention takes no dropout, causal mask or GQA")
        return attention_with_lse(call["query"], call["key"], call["value"], call["attn_mask"], call["scale"])

    setattr(forward_op, _INSTALLED, True)
    attention_dispatch._native_attention_forward_op = forward_op
