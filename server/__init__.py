"""The HTTP layer: FastAPI app, OpenAI wire schemas, media encoding, errors, and the CLI.

It reaches models only through `engine/`, and never imports torch or diffusers.
"""
