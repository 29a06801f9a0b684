"""The decoder projections (and the LM head, ``WeightQuant.head``) quantized while the checkpoint streams in.

Each checkpoint matrix is quantized into its projection's rows as it arrives, a piece of rows at a time (rows
are quantized independently, so the parts of a fused projection store what the fused weight would): no float
copy of a projection is built on the device, only the pieces' fp32 working copies. A projection whose
matrices are all stored as integers that its quantized format holds unchanged (the stored format's ``keeps``:
:mod:`.integer`, :mod:`.awq`, :mod:`.gptq`) is filled from them instead. A head tied to the embedding table is
quantized from the table once the checkpoint is in; the table stays.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model.qwen3_vl import Qwen3VLModel
from ..model.text import FusedLinear
from .quant import QuantizedLinear, WeightQuant
from .sites import HEAD, Site
from .stored_format import StoredFormat


class QuantizeOnLoad:
    """Quantizes (or keeps as stored) the projections of ``sites`` that ``quant`` names, as their matrices
    come; ``stored``: the checkpoint views stored in ``fmt``'s integers or FP8 (with companions)."""

    def __init__(
        self,
        sites: dict[str, Site],
        quant: WeightQuant,
        tied: bool,
        dtype: torch.dtype,
        device: torch.device,
        fmt: StoredFormat | None,
        stored: frozenset[str],
    ) -> None:
        self.dtype, self.device, self.fmt = dtype, device, fmt
        self.tied_head = quant.head if tied else None
        # module name -> how it is stored, and its module as built on meta (its shape and fused parts)
        self.how = {name: quant for name, site in sites.items() if not site.is_head}
        if quant.head and not tied:
            self.how[HEAD] = quant.head
        self.modules: dict[str, nn.Module] = {name: sites[name].module for name in self.how}
        self.owner = {view: name for name in self.how for view in sites[name].views}  # view -> module name
        self.deferred = frozenset(id(m.weight) for m in self.modules.values())  # left on meta: replaced here
        # module name -> how it keeps the checkpoint's stored values (all of its matrices are stored so)
        self.keeping: dict[str, WeightQuant] = {}
        for name, how in self.how.items():
            keep = fmt.keeps(how) if fmt and sites[name].views <= stored else None
            if keep:
                self.keeping[name] = keep
        # The group size applies where the node picks the groups: not to projections kept in the checkpoint's.
        quant.check(
            tuple(
                self.modules[name].weight.shape[1]
                for name, how in self.how.items()
                if how is quant and self.keeping.get(name, quant).group_size == quant.group_size
            )
        )
        self.building: dict[str, QuantizedLinear] = {}  # projections being filled

    def takes(self, view: str) -> bool:
        """Whether the checkpoint matrix ``view`` goes into a quantized projection."""
        return view in self.owner

    def kept_views(self) -> set[str]:
        """The checkpoint views whose stored values are kept (:meth:`store`, not :meth:`quantize`)."""
        return {view for view, name in self.owner.items() if name in self.keeping}

    def quantize(self, view: str, weight: torch.Tensor) -> None:
        """The float checkpoint matrix ``view`` (on any device) quantized into its projection's rows from the
        values the float model holds (cast to its dtype a piece at a time on the device: no whole-matrix copy
        there, which for the 8B's untied LM head in fp16 from bf16 would be 2.5 GB of a Jetson's memory)."""
        name = self.owner[view]
        module = self._building(name, self.how[name])
        module.quantize_rows(self._rows(name, view), weight, self.dtype)

    def store(self, view: str, tensor: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """The stored matrix ``view`` (and its scales etc., ``parts``) into its kept projection's rows."""
        name = self.owner[view]
        module = self._building(name, self.keeping[name])
        self.fmt.store_into(module, self._rows(name, view), tensor, **parts)

    def built(self, name: str) -> QuantizedLinear | None:
        """Projection ``name`` once its last matrix is in (None: it is not quantized)."""
        return self.building.pop(name, None)

    def tied_head_module(self, model: Qwen3VLModel) -> QuantizedLinear | None:
        """After the last tensor: a tied head quantized from the embedding table (which stays as it is)."""
        if not self.tied_head:
            return None
        return QuantizedLinear.from_weight(model.language_model.embed_tokens.weight, self.tied_head)

    def _building(self, name: str, how: WeightQuant) -> QuantizedLinear:
        """Projection ``name`` as it is being filled, allocated in ``how``'s format when its first matrix comes."""
        if name not in self.building:
            n, k = self.modules[name].weight.shape
            self.building[name] = QuantizedLinear(n, k, how.mode, how.group_size, device=self.device)
        return self.building[name]

    def _rows(self, name: str, view: str) -> slice:
        """The rows of projection ``name``'s weight that the checkpoint matrix ``view`` fills."""
        module = self.modules[name]
        if not isinstance(module, FusedLinear):
            return slice(0, module.weight.shape[0])
        return module.part_rows()[view.rsplit(".", 2)[-2]]
