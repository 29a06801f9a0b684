"""Where the decoder's projections and the LM head sit in the model, and which checkpoint matrices fill each.

A projection is built once its matrices are in: the loader counts them off per site (:class:`SiteFill`) and
hands the finished weights to :class:`.projections.ProjectionBuilder`, which puts the module that multiplies
them on this device in the site's place.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..model.qwen3_vl import Qwen3VLModel
from ..model.text import FusedLinear, takes_swiglu

HEAD = "lm_head"


@dataclass(frozen=True)
class Site:
    """One projection's place: ``getattr(parent, attr)``, the checkpoint views that fill its weight (its
    parameter view names), and whether the SwiGLU follows its product (the kernels then run it in the launch)."""

    parent: nn.Module
    attr: str
    views: frozenset[str]
    swiglu: bool

    @property
    def module(self) -> nn.Module:
        return getattr(self.parent, self.attr)

    @property
    def is_head(self) -> bool:
        return self.attr == HEAD


def projection_sites(model: Qwen3VLModel) -> dict[str, Site]:
    """Every decoder projection by module name, in layer order, then the LM head (``lm_head``)."""
    sites: dict[str, Site] = {}
    for i, layer in enumerate(model.language_model.layers):
        for sub, attr in layer.PROJECTIONS:
            parent = getattr(layer, sub)
            module = getattr(parent, attr)
            parts = module.parts if isinstance(module, FusedLinear) else {attr: 0}
            views = frozenset(f"language_model.layers.{i}.{sub}.{part}.weight" for part in parts)
            sites[f"language_model.layers.{i}.{sub}.{attr}"] = Site(parent, attr, views, takes_swiglu(parent, attr))
    sites[HEAD] = Site(model, HEAD, frozenset({"lm_head.weight"}), False)
    return sites


class SiteFill:
    """The checkpoint views each site still waits for: :meth:`loaded` names the site a view completed, once."""

    def __init__(self, sites: dict[str, Site], planned: set[str]) -> None:
        # Only views the checkpoint fills: a tied head's weight is the embedding table, no view of its own.
        self.remaining = {name: set(site.views) & planned for name, site in sites.items()}
        self.owner = {view: name for name, site in sites.items() for view in site.views}
        self.built: set[str] = set()

    def loaded(self, view: str) -> str | None:
        """The site ``view`` was the last matrix of, else None."""
        name = self.owner.get(view)
        if name is None or name in self.built:
            return None
        self.remaining[name].discard(view)
        if self.remaining[name]:
            return None
        self.built.add(name)
        return name

    def rest(self) -> list[str]:
        """The sites no view completed (a head tied to the embedding table), to build after the last tensor."""
        rest = [name for name in self.remaining if name not in self.built]
        self.built.update(rest)
        return rest
