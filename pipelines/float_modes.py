"""The CPU's treatment of subnormal floats in the threads that run a pipeline.

Arithmetic on subnormals (magnitudes below ~1.2e-38 in float32) takes a slow microcode path
on x86 CPUs, tens of times slower per operation. A denoiser whose activations drift into
that range slows down by as much for some prompts only: on a Qwen-Image-shaped model with
small random weights, two prompts of eight took 0.5-1.7 s a request where the others took
30-90 ms. Flush-to-zero (results) and denormals-are-zero (inputs) replace them with zero, a
change below float32's precision for any image. The setting is per thread; a thread started
later inherits its starter's (POSIX), so setting it first thing in the thread that loads
the pipeline covers the threads that thread starts: torch's own compute threads, the decode
and preview-fit threads."""

from __future__ import annotations


def flush_denormals(enabled: bool) -> bool:
    """Turn flush-to-zero and denormals-are-zero on (or off) in the calling thread; whether
    this CPU has them (False: the setting changed nothing)."""
    import torch  # here: importing this module must not import torch

    return bool(torch.set_flush_denormal(enabled))
