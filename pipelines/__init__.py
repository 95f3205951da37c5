"""Adapters over diffusers pipelines, their registry, and the embedded tiny models.

The only package that touches torch and diffusers (besides the executor hosting it).
"""
