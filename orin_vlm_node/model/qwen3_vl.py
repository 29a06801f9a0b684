"""Qwen3-VL (dense 2B/4B/8B): vision tower + Qwen3 decoder with DeepStack, one sequence per call.

The model is pure tensor math over one step of one sequence. It does not know about KV slots,
paging, sessions or sampling: the caller passes RoPE positions (see :mod:`.positions`) and a
:class:`StepAttention` from the KV backend, and receives logits for the rows it asked for.

Submodule names match the checkpoint (``visual`` <- ``model.visual``, ``language_model`` <-
``model.language_model``, ``lm_head``) so the loader maps keys by prefix only.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kvcache import StepAttention
from .config import ModelConfig
from .text import TextDecoder, add_rms_norm
from .vision import VisionFeatures, VisionTower


class Qwen3VLModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.visual = VisionTower(config.vision)
        self.language_model = TextDecoder(config.text)
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.language_model.embed_tokens.weight

    def num_parameters(self) -> int:
        """Parameter count with shared (tied) tensors counted once."""
        return sum(p.numel() for p in self.parameters())  # parameters() already de-duplicates

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.language_model.embed_tokens.weight.device

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionFeatures:
        """Vision tower over all images: (N, 1536) patches + (n, 3) grids -> (M, H) tokens, M = sum(t*h*w)/4."""
        return self.visual(pixel_values, grid_thw)

    # inference_mode rather than no_grad: no version counters or autograd bookkeeping per op, about 15% of a
    # small model's decode step. The outputs are inference tensors; callers read or clone them, never
    # modify them in place. (The KV cache, an ordinary tensor, may be written in place inside.)
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        rope_positions: torch.Tensor,
        attn: StepAttention,
        vision: VisionFeatures | None = None,
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (K, vocab) of one step of one sequence.

        ``input_ids`` (L,) long, ``rope_positions`` (3, L) long. ``vision``: features whose rows fill
        this chunk's ``<|image_pad|>`` and ``<|video_pad|>`` positions in order (their count must match;
        for a prefill split into chunks pass ``features.rows(a, b)``, the rows of the pads inside the chunk). With
        ``vision=None`` image-pad ids are embedded like any token. ``logits_index``: (K,) rows to
        project; default the last row. With ``vision=None`` there is no host sync and no
        data-dependent shape, so a decode step can be captured in a CUDA graph.
        """
        if input_ids.dim() != 1 or rope_positions.shape != (3, input_ids.shape[0]):
            raise ValueError(
                f"expected input_ids (L,) and rope_positions (3, L); got {tuple(input_ids.shape)} and "
                f"{tuple(rope_positions.shape)}"
            )
        decoder = self.language_model
        x = decoder.embed_tokens(input_ids)  # (L, H)
        visual_rows = None
        if vision is not None:
            image, video = self.config.visual_token_ids
            visual_rows = torch.nonzero((input_ids == image) | (input_ids == video)).reshape(-1)  # host sync
            if visual_rows.numel() != vision.embeds.shape[0]:
                raise ValueError(
                    f"this chunk has {visual_rows.numel()} image and video pad tokens but {vision.embeds.shape[0]} "
                    "feature rows were given"
                )
            x = x.index_copy(0, visual_rows, vision.embeds.to(x.device, x.dtype))
        rope = decoder.rope_tables(rope_positions, x.dtype)
        delta = None  # the last layer's tail after attention (a LayerTail), added by the next norm
        for index, layer in enumerate(decoder.layers):
            x, delta = layer(x, delta, rope, attn, index)
            if visual_rows is not None and index < len(vision.deepstack):
                # DeepStack: add level `index` to this layer's OUTPUT at the image positions
                # (docs/architecture.md, pitfall 7).
                x, delta = delta.added_to(x), None
                x = x.index_add(0, visual_rows, vision.deepstack[index].to(x.device, x.dtype))
        # Only the rows whose logits are wanted go through the last layer's o product and MLP, the final add and
        # norm (no host tensor here: a decode step is captured in a CUDA graph).
        rows = logits_index.to(x.device) if logits_index is not None else None
        x = x[-1:] if rows is None else x.index_select(0, rows)
        if delta is not None:
            delta = delta.rows(rows)
        return self.lm_head(add_rms_norm(decoder.norm, x, delta)[1])

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (rotary tables) after parameters were materialised."""
        self.language_model.init_buffers()
