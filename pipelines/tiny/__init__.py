"""Embedded tiny models: real diffusers pipelines with small random weights.

They are built offline and deterministically on first use into a cache directory, then
loaded with `from_pretrained` like any other local model, so the server, the tests and the
benchmarks run anywhere with no download. Their images are noise.
"""

from pipelines.tiny.cache import TINY_MODELS, TinyModel, is_tiny_model, tiny_model_dir

__all__ = ["TINY_MODELS", "TinyModel", "is_tiny_model", "tiny_model_dir"]
