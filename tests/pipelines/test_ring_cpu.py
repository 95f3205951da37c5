"""Ring attention's partial attention on the CPU (`pipelines.parallel.ring_cpu`): its output is
torch's `scaled_dot_product_attention`'s and its log-sum-exp the scores' over the keys, with
and without a mask, in diffusers' layouts; two key shares merged as diffusers 0.42.1's
`TemplatedRingAttention` merges them give the whole attention; installed, diffusers' native
op returns it where asked for the log-sum-exp and is itself otherwise. The lanes:
tests/pipelines/test_sequence_parallel.py."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import logsigmoid, scaled_dot_product_attention, sigmoid

from pipelines.parallel.ring_cpu import attention_with_lse, install

B, S, KEYS, H, D = 2, 6, 8, 3, 4


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query (B, S, H, D), key and value (B, KEYS, H, D): diffusers' layout."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(B, S, H, D, generator=generator)
    key, value = (torch.randn(B, KEYS, H, D, generator=generator) for _ in range(2))
    return query, key, value


def _masks() -> dict[str, torch.Tensor | None]:
    """None; keys hidden per row (a text's padding, (B, 1, 1, KEYS), every query seeing some);
    an additive mask per head and query."""
    keep = torch.ones(B, 1, 1, KEYS, dtype=torch.bool)
    keep[0, ..., 5:] = False
    keep[1, ..., :2] = False
    bias = torch.randn(B, H, S, KEYS, generator=torch.Generator().manual_seed(1))
    return {"none": None, "bool": keep, "additive": bias}


def _expected(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    scores = q @ k.transpose(-2, -1) / D**0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return out, torch.logsumexp(scores, dim=-1).transpose(1, 2)


@pytest.mark.parametrize("mask", ["none", "bool", "additive"])
def test_the_output_is_torch_attention_and_the_lse_the_scores_log_sum_exp(mask: str) -> None:
    query, key, value = _qkv()
    attn_mask = _masks()[mask]
    out, lse = attention_with_lse(query, key, value, attn_mask)
    expected_out, expected_lse = _expected(query, key, value, attn_mask)
    assert out.shape == (B, S, H, D) and lse.shape == (B, S, H)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, expected_lse)


@pytest.mark.parametrize("mask", ["none", "bool"])
def test_two_key_shares_merged_as_diffusers_ring_merges_them_are_the_whole_attention(mask: str) -> None:
    query, key, value = _qkv()
    attn_mask = _masks()[mask]
    prev_out = prev_lse = None
    for share in range(2):
        keys = slice(share * KEYS // 2, (share + 1) * KEYS // 2)
        part_mask = None if attn_mask is None else attn_mask[..., keys]
        out, lse = attention_with_lse(query, key[:, keys], value[:, keys], part_mask)
        lse = lse.unsqueeze(-1)
        # diffusers 0.42.1's TemplatedRingAttention.forward, as it merges each share.
        if prev_out is not None and prev_lse is not None:
            out = prev_out - sigmoid(lse - prev_lse) * (prev_out - out)
            lse = prev_lse - logsigmoid(prev_lse - lse)
        prev_out, prev_lse = out, lse
    expected_out, expected_lse = _expected(query, key, value, attn_mask)
    assert prev_out is not None and prev_lse is not None
    torch.testing.assert_close(prev_out, expected_out)
    torch.testing.assert_close(prev_lse.squeeze(-1), expected_lse)


def test_installed_the_native_op_returns_the_lse_where_asked_and_is_itself_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from diffusers.models import attention_dispatch

    native = attention_dispatch._native_attention_forward_op
    query, key, value = _qkv()
    with pytest.raises(ValueError, match="return_lse"):  # why this module exists
        native(None, query, key, value, return_lse=True, _save_ctx=False)
    monkeypatch.setattr(attention_dispatch, "_native_attention_forward_op", native)  # put back after
    install()
    installed = attention_dispatch._native_attention_forward_op
    install()  # once
    assert attention_dispatch._native_attention_forward_op is installed is not native
    out, lse = installed(None, query, key, value, None, 0.0, False, None, False, True, _save_ctx=False)
    expected_out, expected_lse = _expected(query, key, value, None)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, expected_lse)
    alone = installed(None, query, key, value, return_lse=False, _save_ctx=False)
    assert torch.equal(alone, native(None, query, key, value, return_lse=False, _save_ctx=False))
