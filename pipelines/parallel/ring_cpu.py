"""Ring attention on the CPU (`--sequence-parallel N --sp-mode ring --device cpu`): the
attention of one key/value share that also returns its log-sum-exp, which diffusers' ring
needs to merge the shares and its native backend does not give.

diffusers 0.42.1's `TemplatedRingAttention` runs the backend's forward op once per device's
keys and values, each time with `return_lse=True`, and merges the partial outputs by their
log-sum-exp (out (B, S, H, D), lse (B, S, H)). The backends whose ops return it (cudnn,
flash, sage) are CUDA kernels; the native backend's op (`_native_attention_forward_op`, the
one the CPU runs) raises on `return_lse`. `attention_with_lse` is that op computed in plain
torch — the scores, their log-sum-exp over the keys, the softmax times the values — and
`install` puts it in the op's place in `diffusers.models.attention_dispatch` for the life
of a ring lane's member on the CPU (`pipelines.parallel.sequence.split_tokens`), as
`sequence._one_mask_for_all_heads` swaps LTX's dispatch for a member's life. Every call
without `return_lse` (Ulysses, one device) goes to diffusers' own op unchanged.

The scores are materialised, (B, H, S, keys of one share) in float32: the memory of torch's
math kernel, a share of the keys at a time.
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
    them out, and its log-sum-exp: out (B, S, H, D) in the query's dtype, lse (B, S, H) in
    float32. `attn_mask` as `scaled_dot_product_attention` takes it, broadcast to (B, H,
    S, keys): True (or an added 0) where a key is seen."""
    q, k, v = (x.transpose(1, 2).to(torch.float32) for x in (query, key, value))
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(scores.dtype)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v
    return out.transpose(1, 2).to(query.dtype), lse.transpose(1, 2)


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
