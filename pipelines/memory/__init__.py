"""Fitting a model in the memory a user has: per-component dtypes, offload, quantized
weights (`loading.py`, applied once when the pipeline loads, with diffusers' own machinery)
and bounded decodes (`decode_budget.py`). `options.py` is torch-free: the server validates
the settings with it before anything loads."""
