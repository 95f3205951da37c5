"""The models a server answers to: its base models and each LoRA adapter served over one.

`/v1/models` lists them all (an adapter with `parent` = its base, as vLLM lists its LoRA
modules), and a request picks one with `model`, or a base plus a `lora` field that may
also set the adapter's scale. A server of several models (`ModelSet`) has one
`ServedModels` per base; `ServedModelList` finds a request's.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import LoraRef
from server.errors import APIError
from server.protocol import LoraChoice, ModelCard


@dataclass(frozen=True, slots=True)
class ServedModels:
    base: str
    adapters: tuple[str, ...] = ()
    # ControlNets served beside it (`--controlnet`): listed, never a request's `model`.
    controlnets: tuple[str, ...] = ()
    # IP-Adapters served beside it (`--ip-adapter`): listed, never a request's `model`.
    ip_adapters: tuple[str, ...] = ()
    # The union ControlNets among `controlnets` with their modes' names (`server.control_modes`).
    control_modes: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def cards(
        self, created: int, modality: str = "unknown", loaded: bool | None = None, state: str | None = None
    ) -> list[ModelCard]:
        """The base and its adapters, with the endpoints its `modality` answers."""
        endpoints = None if modality == "unknown" else modality.split("+")
        base = ModelCard(
            id=self.base, created=created, root=self.base, endpoints=endpoints, loaded=loaded, state=state
        )
        adapters = [base.model_copy(update={"id": a, "parent": self.base}) for a in self.adapters]
        modes = dict(self.control_modes)
        controlnets = [
            base.model_copy(
                update={"id": c, "parent": self.base, "kind": "controlnet", "modes": _listed(modes.get(c))}
            )
            for c in self.controlnets
        ]
        ip_adapters = [
            base.model_copy(update={"id": a, "parent": self.base, "kind": "ip_adapter"})
            for a in self.ip_adapters
        ]
        return [base, *adapters, *controlnets, *ip_adapters]

    def check_controlnets(self, names: list[str]) -> None:
        """400 naming `controlnet[i].name` for a ControlNet not served with this base."""
        _check_served("ControlNet", "controlnet", names, self.controlnets, self.base)

    def check_ip_adapters(self, names: list[str]) -> None:
        """400 naming `ip_adapter[i].name` for an IP-Adapter not served with this base."""
        _check_served("IP-Adapter", "ip_adapter", names, self.ip_adapters, self.base)

    def lora_for(self, model: str | None, choice: LoraChoice | None) -> LoraRef | None:
        """The adapter a request asks for (None: the base model); 404 for a model or adapter
        this server does not serve, 400 when `model` and `lora` name different adapters."""
        if model is not None and model != self.base and model not in self.adapters:
            served = ", ".join(repr(name) for name in (self.base, *self.adapters))
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )
        if choice is not None and choice.name not in self.adapters:
            known = ", ".join(repr(name) for name in self.adapters) or "none"
            raise APIError(
                404,
                f"the LoRA adapter {choice.name!r} does not exist; this server serves {known}",
                param="lora",
                code="model_not_found",
            )
        if model is not None and model != self.base:
            if choice is not None and choice.name != model:
                raise APIError(
                    400,
                    f"model {model!r} and lora {choice.name!r} name different adapters; send one",
                    param="lora",
                )
            return LoraRef(model, 1.0 if choice is None else choice.scale)
        return None if choice is None else LoraRef(choice.name, choice.scale)


def _listed(names: tuple[str, ...] | None) -> list[str] | None:
    return None if names is None else list(names)


@dataclass(frozen=True, slots=True)
class ServedModelList:
    """Every base model a server serves, with its adapters; the first is the default."""

    bases: tuple[ServedModels, ...]

    @property
    def default(self) -> ServedModels:
        return self.bases[0]

    def base_of(self, model: str | None) -> ServedModels:
        """The base that serves `model` (a base or one of its adapters); 404 otherwise."""
        if model is None:
            return self.default
        for served in self.bases:
            if model == served.base or model in served.adapters:
                return served
        names = ", ".join(repr(n) for served in self.bases for n in (served.base, *served.adapters))
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {names}",
            param="model",
            code="model_not_found",
        )

    def lora_for(self, model: str | None, choice: LoraChoice | None) -> LoraRef | None:
        return self.base_of(model).lora_for(model, choice)

    def cards(self, created: int, states: dict[str, tuple[str, bool, str | None]]) -> list[ModelCard]:
        """Every base and adapter; `states`: each base's modality, whether it is loaded, and
        its residency state (None for a server of one model)."""
        return [
            card
            for served in self.bases
            for card in served.cards(created, *states.get(served.base, ("unknown", None)))
        ]


def _check_served(noun: str, field: str, names: list[str], served: tuple[str, ...], base: str) -> None:
    for index, name in enumerate(names):
        if name not in served:
            known = ", ".join(repr(s) for s in served) or "none"
            raise APIError(
                400,
                f"the {noun} {name!r} is not served with {base!r}; served: {known}",
                param=f"{field}[{index}].name",
            )
