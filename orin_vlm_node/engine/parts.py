"""``EngineParts``: everything a request runs on, assembled from one ``EngineConfig`` (:mod:`.assemble`).

The scheduler and each request run receive these parts, never the engine that owns them: a run is handed
the parts in effect when it is admitted, and a reconfiguration (which waits until no request runs) swaps
the whole object. The KV cache, the session store and the decode step are None only while a rebuild has
released them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..cuda import BackendChoice
    from ..kvcache import KVCache
    from ..model import Qwen3VLModel
    from ..model.config import ModelConfig
    from ..processing import ImageProcessor, Tokenizer
    from .config import EngineConfig
    from .decode_step import DecodeStep
    from .events import SamplingParams
    from .images import VisionCache
    from .output_format import Grammars
    from .prompt import TurnPreparer
    from .session import SessionStore


@dataclass(eq=False)
class EngineParts:
    """The model with its projections routed, its processing, the KV cache, sessions and decode step."""

    config: EngineConfig  # the settings these parts were assembled from
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    model: Qwen3VLModel | None
    weight_bytes: int
    checkpoint_weights: str  # how the checkpoint stores its weights ("float", or its stored format)
    weight_path: str  # how the projections multiply: the kernels each was built with
    tokenizer: Tokenizer
    image_processor: ImageProcessor
    turns: TurnPreparer
    grammars: Grammars  # compiles output formats for this tokenizer
    generation_defaults: SamplingParams
    vision_cache: VisionCache
    attention: BackendChoice
    cache: KVCache | None
    session_store: SessionStore | None
    decode_step: DecodeStep | None
