"""Qwen3-VL vision tower: patches of several images in, merged LLM tokens + DeepStack features out.

More in docs/modules.md, ``orin_vlm_node/model/vision.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import VisionConfig
from .embedding import checkpoint_embedding
from .rope import apply_vision_rope, vision_cos_sin, vision_inv_freq


@dataclass
class VisionFeatures:
    """Encoded images, ready to be scattered into the prompt.

    ``embeds`` (M, H): one row per ``<|image_pad|>`` token, images in order. ``deepstack``: one (M, H)
    tensor per DeepStack level, added after decoder layers 0, 1, ... at the same positions.
    ``tokens_per_image``: how the M rows split into images.
    """

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]
    tokens_per_image: tuple[int, ...] = ()

    def __len__(self) -> int:
        return int(self.embeds.shape[0])

    def rows(self, start: int, stop: int) -> VisionFeatures:
        """Rows ``start:stop`` (for a prefill chunk that holds only part of the image tokens)."""
        return VisionFeatures(self.embeds[start:stop], [d[start:stop] for d in self.deepstack], ())


class PatchEmbed(nn.Module):
    """Conv3d weights (D, 3, 2, 16, 16) + bias, applied as one Linear over 1536 inputs."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = nn.Conv3d(
            cfg.in_channels,
            cfg.hidden_size,
            kernel_size=(cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
            stride=(cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
            bias=True,
        )

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # (N, 1536) -> (N, D)
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg_lens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim)
        # q and k rotated in one pass: (N, 2, heads, hd) with the tables broadcast over both.
        q, k = apply_vision_rope(qkv[:, :2], cos[:, None], sin[:, None]).unbind(1)
        # (1, heads, N, hd): bidirectional attention inside each segment only (block-diagonal). The batch
        # axis is there for torch's fused CPU kernel, which takes 4-D inputs only (3-D ones run the
        # unfused math path, ~3x slower at the default model's sizes).
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, qkv[:, 2]))
        if len(seg_lens) == 1:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            out = torch.cat(
                [
                    F.scaled_dot_product_attention(qs, ks, vs)
                    for qs, ks, vs in zip(q.split(seg_lens, 2), k.split(seg_lens, 2), v.split(seg_lens, 2), strict=True)
                ],
                dim=2,
            )
        return self.proj(out[0].transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg_lens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, seg_lens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """2x2 patches -> one LLM token. ``postshuffle_norm``: LayerNorm(4D) after the concat (DeepStack)."""

    def __init__(self, cfg: VisionConfig, postshuffle_norm: bool):
        super().__init__()
        self.merged_dim = cfg.hidden_size * cfg.merge_unit
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle_norm else cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim, bias=True)
        self.linear_fc2 = nn.Linear(self.merged_dim, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, D) -> (N/4, H)
        if self.postshuffle_norm:
            x = self.norm(x.reshape(-1, self.merged_dim))
        else:
            x = self.norm(x).reshape(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


# Grid sets whose position/rotary tables the tower keeps (a few camera sizes; a few MB at most).
GRID_TABLES_KEPT = 8


@dataclass(frozen=True)
class _GridTables:
    """What the tower computes from the grids alone: (N, D) fp32 position embedding, (N, hd) fp32 cos
    and sin, and the attention segment lengths (one per image and temporal slice)."""

    position: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    seg_lens: list[int]


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.grid_side = int(cfg.num_position_embeddings**0.5)
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = checkpoint_embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes
        )
        self._tables: dict[tuple, _GridTables] = {}  # oldest first; see _grid_tables

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionFeatures:
        """``pixel_values`` (N, 1536) patches of all images in merge-block order; ``grid_thw`` (n, 3)."""
        cfg = self.cfg
        grids = _validate_inputs(cfg, pixel_values, grid_thw)
        tables = self._grid_tables(tuple(grids))
        x = self.patch_embed(pixel_values.to(tables.position.device))
        x = x + tables.position.to(x.dtype)
        deepstack: list[torch.Tensor] = []
        for index, block in enumerate(self.blocks):
            x = block(x, tables.cos, tables.sin, tables.seg_lens)
            if index in cfg.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[cfg.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(x))
        tokens = tuple(t * h * w // cfg.merge_unit for t, h, w in grids)
        return VisionFeatures(self.merger(x), deepstack, tokens)

    def _grid_tables(self, grids: tuple[tuple[int, int, int], ...]) -> _GridTables:
        """The position embedding and rotary tables of these grids, computed once per grid set.

        A robot's cameras send frames of one size, so every frame has the same grids: the tables are
        kept (the last ``GRID_TABLES_KEPT`` grid sets) and rebuilt when the position table changes.
        """
        weight = self.pos_embed.weight
        key = (grids, weight.device, weight._version, weight.data_ptr())
        tables = self._tables.get(key)
        if tables is None:
            device = weight.device
            rows_cols = _patch_rows_cols(list(grids), self.cfg.spatial_merge_size).to(device)  # (N, 2)
            cos, sin = vision_cos_sin(rows_cols, vision_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, device))
            seg_lens = [h * w for t, h, w in grids for _ in range(t)]
            tables = _GridTables(self._position_embedding(list(grids), rows_cols), cos, sin, seg_lens)
            while len(self._tables) >= GRID_TABLES_KEPT:
                self._tables.pop(next(iter(self._tables)))
            self._tables[key] = tables
        return tables

    def _position_embedding(self, grids: list[tuple[int, int, int]], rows_cols: torch.Tensor) -> torch.Tensor:
        """(N, D) fp32: bilinear (align_corners=True) resample of the learned table at each patch."""
        side = self.grid_side
        per_image = torch.tensor([[h, w] for _, h, w in grids], device=rows_cols.device)
        counts = torch.tensor([t * h * w for t, h, w in grids], device=rows_cols.device)
        sizes = per_image.repeat_interleave(counts, dim=0)  # (N, 2): (h, w) of each patch's image
        # src = i * (S - 1) / max(n - 1, 1), in fp32 and in this operation order (as HF 5.x).
        src = rows_cols.to(torch.float32) * (side - 1) / torch.clamp(sizes - 1, min=1)  # (N, 2)
        floor = torch.floor(src)
        offsets = torch.arange(2, device=src.device)  # taps floor, floor + 1
        taps = (floor.long()[..., None] + offsets).clamp(0, side - 1)  # (N, 2 axes, 2 taps)
        weights = (1 - (src[..., None] - floor[..., None] - offsets).abs()).clamp(min=0)
        index = (taps[:, 0, :, None] * side + taps[:, 1, None, :]).reshape(-1, 4)  # (N, 4): y0x0 y0x1 y1x0 y1x1
        weight = (weights[:, 0, :, None] * weights[:, 1, None, :]).reshape(-1, 4)
        return (self.pos_embed(index) * weight[:, :, None]).sum(1)


def _validate_inputs(
    cfg: VisionConfig, pixel_values: torch.Tensor, grid_thw: torch.Tensor
) -> list[tuple[int, int, int]]:
    """Grid rows as ints; ValueError naming the mismatch for malformed inputs."""
    if not isinstance(grid_thw, torch.Tensor) or grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        shape = tuple(grid_thw.shape) if isinstance(grid_thw, torch.Tensor) else type(grid_thw).__name__
        raise ValueError(f"grid_thw must be a (n, 3) tensor, got {shape}")
    if pixel_values.dim() != 2 or pixel_values.shape[1] != cfg.patch_dim:
        raise ValueError(f"pixel_values must be (N, {cfg.patch_dim}), got {tuple(pixel_values.shape)}")
    grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
    if not grids:
        raise ValueError("grid_thw has no rows (no images to encode)")
    m = cfg.spatial_merge_size
    for i, (t, h, w) in enumerate(grids):
        if t < 1 or h < m or w < m or h % m or w % m:
            raise ValueError(f"grid_thw row {i} = {[t, h, w]}: need t >= 1 and h, w positive multiples of {m}")
    total = sum(t * h * w for t, h, w in grids)
    if total != pixel_values.shape[0]:
        raise ValueError(f"grid_thw describes {total} patches but pixel_values has {pixel_values.shape[0]} rows")
    return grids


def _patch_rows_cols(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(N, 2) long (row, col) of every patch in the unmerged grid, in merge-block order, repeated over t."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h).reshape(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        cols = torch.arange(w).reshape(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        # (h/m, m, w/m, m) -> (h/m, w/m, m, m): block-row, block-col, in-row, in-col
        rc = torch.stack((rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)), dim=-1)
        out.append(rc.repeat(t, 1))
    return torch.cat(out, dim=0)
