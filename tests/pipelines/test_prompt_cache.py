"""The prompt-embedding cache on a fake `encode_prompt`: texts split and put back in order,
identical texts encoded once, bytes bounded, the adapter in the key, nothing handed out
that a caller could change, and calls it cannot key passed through."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.request import LoraRef
from pipelines.prompt_cache import UNCACHEABLE, CachedEncodePrompt, PromptCache


class FakeEncoder:
    """Embeds each text as a row of its character codes (padded to `length` with zeros), a
    pooled row (its length), and FLUX-like shared text ids; logs the texts of each call."""

    def __init__(self, length: int = 8) -> None:
        self.length = length
        self.calls: list[list[str]] = []

    def __call__(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        num_images_per_prompt: int = 1,
        max_sequence_length: int = 8,
        prompt_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        self.calls.append(texts)
        rows = torch.zeros(len(texts), self.length)
        for row, text in enumerate(texts):
            codes = [float(ord(c)) for c in text[: self.length]]
            rows[row, : len(codes)] = torch.tensor(codes)
        pooled = torch.tensor([[float(len(t))] for t in texts])
        embeds = rows.repeat_interleave(num_images_per_prompt, dim=0)
        return embeds, pooled.repeat_interleave(num_images_per_prompt, dim=0), torch.zeros(self.length, 3)


def cached(encoder: FakeEncoder, capacity: int = 2**20, scope: Any = None) -> CachedEncodePrompt:
    return CachedEncodePrompt(encoder, PromptCache(capacity), lambda: scope)


def same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_each_text_is_encoded_once_and_the_rows_come_back_in_order() -> None:
    reference, encoder = FakeEncoder(), FakeEncoder()
    encode = cached(encoder)
    texts = ["cat", "dog", "cat", "moon", "dog"]
    assert same(encode(texts), reference(texts))
    assert encoder.calls == [["cat", "dog", "moon"]]
    assert same(encode(["moon", "sun", "cat"]), reference(["moon", "sun", "cat"]))
    assert encoder.calls[1] == ["sun"]
    counts = encode.cache.counts()
    assert (counts["hits"], counts["misses"], counts["entries"]) == (4, 4, 4)


def test_images_per_prompt_keep_each_texts_rows_together() -> None:
    encode = cached(FakeEncoder())
    encode(["a"], num_images_per_prompt=2)
    got = encode(["b", "a"], num_images_per_prompt=2)
    assert same(got, FakeEncoder()(["b", "a"], num_images_per_prompt=2))


def test_the_adapter_and_every_other_argument_are_in_the_key() -> None:
    encoder = FakeEncoder()
    scope: list[Any] = [None]
    encode = CachedEncodePrompt(encoder, PromptCache(2**20), lambda: scope[0])
    encode(["cat"])
    encode(["cat"], max_sequence_length=4)
    encode(["cat"], negative_prompt="ugly")
    scope[0] = LoraRef("style", 0.5)
    encode(["cat"])
    scope[0] = LoraRef("style", 1.0)
    encode(["cat"])
    assert len(encoder.calls) == 5
    scope[0] = UNCACHEABLE  # after a failed LoRA load: the adapter in the model is not known
    encode(["cat"])
    encode(["cat"])
    assert len(encoder.calls) == 7


def test_what_a_caller_gets_is_its_own() -> None:
    encode = cached(FakeEncoder())
    first = encode(["cat"])
    for tensor in first:
        tensor.mul_(0)  # a step that changed its conditioning in place
    assert same(encode(["cat"]), FakeEncoder()(["cat"]))


def test_the_cache_stays_within_its_bytes_least_recently_used_out() -> None:
    # Each text: 8 floats of embeds, 1 pooled, 8x3 shared ids = 33 floats = 132 bytes.
    encoder = FakeEncoder()
    encode = cached(encoder, capacity=2 * 132)
    encode(["a"])
    encode(["b"])
    encode(["a"])  # a is the most recently used
    encode(["c"])  # evicts b
    encode(["a"])
    encode(["b"])
    assert encoder.calls == [["a"], ["b"], ["c"], ["b"]]
    counts = encode.cache.counts()
    assert counts["bytes"] <= 2 * 132 and counts["evictions"] == 2


def test_texts_of_different_lengths_are_encoded_together_as_uncached() -> None:
    class Padded(FakeEncoder):
        """Pads to the longest text of the call (Qwen-Image's encoder)."""

        def __call__(self, prompt: Any, *args: Any, **kwargs: Any) -> Any:
            self.length = max(len(t) for t in ([prompt] if isinstance(prompt, str) else prompt))
            return super().__call__(prompt, *args, **kwargs)

    encoder = Padded()
    encode = cached(encoder)
    encode(["ab"])
    assert same(encode(["ab", "abcd"]), Padded()(["ab", "abcd"]))
    # "abcd" alone did not fit beside "ab": both encoded together, and from then on a call
    # with a text missing encodes all of its texts.
    assert encoder.calls == [["ab"], ["abcd"], ["ab", "abcd"]]
    assert same(encode(["abcd", "ab"]), Padded()(["abcd", "ab"]))
    assert same(encode(["abc", "ab"]), Padded()(["abc", "ab"]))
    assert encoder.calls[3:] == [["abc", "ab"]]


def test_calls_with_embeddings_or_no_prompt_pass_through() -> None:
    encoder = FakeEncoder()
    encode = cached(encoder)
    encode(["cat"], prompt_embeds=torch.zeros(1, 8))
    encode(["cat"], prompt_embeds=torch.zeros(1, 8))
    encode(["cat"], prompt_embeds=(torch.zeros(1, 8),))
    assert len(encoder.calls) == 3
    assert encode.cache.counts()["entries"] == 0


def test_lists_of_plain_values_are_part_of_the_key() -> None:
    def encoder(prompt: list[str], instruction: list[str] | None = None) -> torch.Tensor:
        calls.append(list(prompt))
        return torch.zeros(len(prompt), 2)

    calls: list[list[str]] = []
    encode = CachedEncodePrompt(encoder, PromptCache(2**20), lambda: None)
    for instruction in (["be brief"], ["be brief"], ["be long"]):
        assert encode(["cat"], instruction=instruction).shape == (1, 2)
    assert calls == [["cat"], ["cat"]]


@pytest.mark.parametrize("negative", [None, "ugly", ["ugly", "bad"]])
def test_negative_prompts_are_per_row_texts(negative: Any) -> None:
    encoder = FakeEncoder()
    encode = cached(encoder)
    encode(["cat", "dog"], negative_prompt=negative)
    encode(["dog", "cat"], negative_prompt=negative[::-1] if isinstance(negative, list) else negative)
    assert len(encoder.calls) == 1
