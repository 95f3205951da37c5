"""The modes (kinds of control image) of the union ControlNets known by their source, in the
order of their numbers — a request's `controlnet[i].mode` — as their model cards name them.
/v1/models lists them on a union ControlNet's card, and the playground offers them.

A union ControlNet loaded from another source (a local copy) takes its modes all the same;
its card lists none, since nothing in its weights names them.
"""

from __future__ import annotations

# xinsir's SDXL union ControlNet (its model card's numbering); ProMax adds tile and repaint.
_XINSIR = ("openpose", "depth", "hed/scribble", "canny/lineart", "normal", "segment")
# InstantX's FLUX.1 union ControlNet (its model card's; modes 7 to 9 are unnamed there).
_INSTANTX = ("canny", "tile", "depth", "blur", "pose", "gray", "low quality")

UNION_MODES: dict[str, tuple[str, ...]] = {
    "xinsir/controlnet-union-sdxl-1.0": _XINSIR,
    "brad-twinkl/controlnet-union-sdxl-1.0-promax": (*_XINSIR, "tile", "repaint"),
    "InstantX/FLUX.1-dev-Controlnet-Union": _INSTANTX,
    # The embedded tiny ones (pipelines.tiny.controlnet): the published names, as many as they have.
    "tiny-sdxl-controlnet-union": _XINSIR,
    "tiny-flux-controlnet-union": _INSTANTX[:4],
}


def union_modes(controlnets: dict[str, str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Each served ControlNet (name -> source) whose source is a known union ControlNet, with
    its modes' names."""
    return tuple((name, UNION_MODES[source]) for name, source in controlnets.items() if source in UNION_MODES)
