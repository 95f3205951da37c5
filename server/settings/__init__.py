"""Serving settings: one validated model (`ServeSettings`) read from built-in defaults, a
YAML preset, `DIFFBATCH_*` variables and flags (`load_settings`), every setting a flag and a
YAML key with one help text.

The settings come in groups, each a class of its own concept module (`section.py` says what
a group declares: its `--help` section, and whether each of several models may set it):
`model.py` (the model, its request defaults, its family's call), `batching.py` (batching and
scheduling), `workers.py` (threads, processes, Ray Serve), `memory.py` (fitting big models),
`acceleration.py` (compiling, attention kernels, caches), `model_set.py` (several models),
`http.py` (listening, TLS, keys; what routes read), `storage.py` (jobs and outputs),
`webhooks.py`, `traces.py` (OpenTelemetry traces). `serve.py` joins them; `sources.py` reads them.
"""

from server.settings.model_set import ModelEntry, deployment_suffix
from server.settings.serve import ServeSettings
from server.settings.sources import ENV_PREFIX, SettingsError, load_settings
from server.settings.storage import OutputSettings

__all__ = [
    "ENV_PREFIX",
    "ModelEntry",
    "OutputSettings",
    "ServeSettings",
    "SettingsError",
    "deployment_suffix",
    "load_settings",
]
