"""LoRA adapters per request: the served adapters of one pipeline, loaded lazily with
diffusers' PEFT integration, at most `max_loras` at once (least recently used unloaded).

A forward (or a step group) uses one adapter at one scale, or none: requests that share it
are in one batch because it is in their batch and step keys. Activating an adapter only
switches which LoRA layers run (`set_adapters` / `disable_lora`); the base weights are never
fused or changed, so a request without an adapter gets exactly the base model's output
whatever ran before it, and one with an adapter gets the same output whichever adapters
were loaded beside it.

Every call here runs on the thread that runs the pipeline's forwards and steps.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.request import InvalidRequestError, LoraRef
from pipelines.base import PipelineConfig
from pipelines.tiny.lora import is_tiny_lora, tiny_lora_dir

logger = logging.getLogger(__name__)


class LoraLoadError(InvalidRequestError):
    """A declared adapter could not be loaded into the model; the requests that name it get
    this error (the server goes on serving the others)."""


class LoraAdapters:
    """The adapters a pipeline may apply (`config.lora_modules`: name -> source) and which
    of them sit in the model now."""

    def __init__(self, pipe: Any, config: PipelineConfig) -> None:
        self.pipe = pipe
        self.model = config.model
        self.sources = dict(config.lora_modules)
        # PEFT's own name for each adapter: served names may hold dots, which PEFT's module
        # dictionaries refuse.
        self.peft_names = {name: f"lora{index}" for index, name in enumerate(self.sources)}
        self.max_loras = config.max_loras
        self.loaded: OrderedDict[str, None] = OrderedDict()  # served names, least recently used first
        self.broken: dict[str, str] = {}  # adapters that cannot load into this model, and why
        # What the model runs with now; `_UNKNOWN` after a failed load, whose clean-up in
        # diffusers may have switched adapters behind our back.
        self.active: LoraRef | object | None = None

    def check(self) -> None:
        """At start: every declared adapter can be found and read (a clear error now, not a
        broken request later). Hub ids cannot be checked offline; they load at first use."""
        if not self.sources:
            return
        if not hasattr(self.pipe, "load_lora_weights"):
            raise ValueError(f"{type(self.pipe).__name__} cannot load LoRA adapters; remove --lora-modules")
        for name, source in self.sources.items():
            check_source(name, source, self.model)

    def activate(self, lora: LoraRef | None) -> None:
        """Make `lora` (None: the base model) the one the next forward runs with."""
        # Always in inference mode: adapters loaded there hold inference tensors, which
        # PEFT's switches (they set requires_grad) may touch only in inference mode.
        with torch.inference_mode():
            self._activate(lora)

    def _activate(self, lora: LoraRef | None) -> None:
        if lora == self.active:
            if lora is not None:
                self.loaded.move_to_end(lora.name)
            return
        if lora is None:
            if self.loaded:
                self.pipe.disable_lora()
        else:
            self._load(lora.name)
            self.pipe.enable_lora()
            self.pipe.set_adapters([self.peft_names[lora.name]], adapter_weights=[lora.scale])
        self.active = lora

    def _load(self, name: str) -> None:
        if name in self.loaded:
            self.loaded.move_to_end(name)
            return
        if name in self.broken:
            raise LoraLoadError(self.broken[name], "model")
        source = self.sources.get(name)
        if source is None:
            raise InvalidRequestError(f"the LoRA adapter {name!r} is not served here", "model")
        while len(self.loaded) >= self.max_loras:
            evicted, _ = self.loaded.popitem(last=False)
            self.pipe.delete_adapters([self.peft_names[evicted]])
            self.active = _UNKNOWN
            logger.info("LoRA %s unloaded to make room (--max-loras %d)", evicted, self.max_loras)
        start = time.perf_counter()
        try:
            self._load_into_model(name, source)
        except Exception as exc:
            problem = (
                f"the LoRA adapter {name!r} ({source}) cannot be loaded into {self.model}: "
                f"{type(exc).__name__}: {exc}"
            )
            if not is_local(source):  # a download may work next time: not remembered
                logger.error("%s; the next request for it tries again", problem)
                raise RuntimeError(problem) from exc
            self.broken[name] = problem  # a file on disk that does not fit this model
            logger.error("%s; requests for it will get this error", problem)
            raise LoraLoadError(problem, "model") from exc
        self.loaded[name] = None
        logger.info("LoRA %s loaded from %s in %.2f s", name, source, time.perf_counter() - start)

    def _load_into_model(self, name: str, source: str) -> None:
        peft_name = self.peft_names[name]
        try:
            with warnings.catch_warnings(), _quiet(_NOISY_LOGGERS):
                # PEFT warns whenever a second adapter joins a model: here that is the point.
                warnings.filterwarnings("ignore", "Already found a `peft_config`", UserWarning)
                path = resolve_source(source, self.model)
                self.pipe.load_lora_weights(path, adapter_name=peft_name)
                if getattr(self.pipe, "transformer_2", None) is not None:
                    # Wan 2.2 A14B: diffusers loads into the high-noise expert unless told to
                    # load into the low-noise one too; a request runs both, so both get it.
                    self.pipe.load_lora_weights(path, adapter_name=peft_name, load_into_transformer_2=True)
            if peft_name not in self._present():  # diffusers skips keys that match no layer, silently
                raise ValueError("none of its weights match this model's layers (a LoRA of another model?)")
        except BaseException:
            # Whatever part reached the model goes; diffusers' own clean-up may also have made
            # another adapter the active one, so the next activation sets it again.
            self.active = _UNKNOWN
            if peft_name in self._present():
                self.pipe.delete_adapters([peft_name])
            raise

    def _present(self) -> set[str]:
        return {adapter for names in self.pipe.get_list_adapters().values() for adapter in names}


_UNKNOWN = object()


# diffusers warns on every load of a LoRA without text-encoder weights (most of them), and
# lists the keys of the adapters loaded before as "missing" from the new one. Loads that
# really fail raise.
_NOISY_LOGGERS = ("diffusers.loaders.lora_base", "diffusers.loaders.peft", "diffusers.utils.peft_utils")


@contextlib.contextmanager
def _quiet(names: tuple[str, ...]) -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


def resolve_source(source: str, model: str) -> str:
    """A local path for embedded tiny LoRAs (built for `model`); others unchanged."""
    return str(tiny_lora_dir(source, model)) if is_tiny_lora(source) else source


def is_local(source: str) -> bool:
    """An embedded tiny LoRA or a path on this machine (else: a hub id)."""
    return is_tiny_lora(source) or Path(source).expanduser().exists()


def check_source(name: str, source: str, model: str) -> None:
    """Raise ValueError naming the adapter if `source` is a local path that is missing or
    holds no LoRA weights, or a tiny LoRA of another model."""
    if is_tiny_lora(source):
        resolve_source(source, model)  # raises if it is not for this model
        return
    path = Path(source).expanduser()
    if not path.exists():
        if source.startswith((".", "/", "~")) or source.count("/") != 1:
            raise ValueError(f"LoRA adapter {name}: {source} does not exist")
        return  # a hub id (org/name): loaded, and checked, at first use
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"LoRA adapter {name}: no .safetensors file in {source}")
    from safetensors import safe_open

    try:
        with safe_open(str(files[0]), framework="pt") as weights:
            keys = list(weights.keys())
    except Exception as exc:  # noqa: BLE001 - the file's own reader says what is wrong
        problem = f"{files[0]} is not a readable safetensors file ({exc})"
        raise ValueError(f"LoRA adapter {name}: {problem}") from None
    if not any("lora" in key.lower() for key in keys):
        raise ValueError(f"LoRA adapter {name}: {files[0]} holds no LoRA weights")
