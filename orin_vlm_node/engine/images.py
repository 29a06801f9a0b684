"""Images of one turn: content keys for the prefix cache, and encoding only what must be computed.

Why content keys: two prompts with identical token ids can still differ in KV, because every image
becomes the same run of ``<|image_pad|>`` ids. The prefix cache therefore keys image-pad tokens by a
hash of the preprocessed patches and their grid, so a new session showing the *same* image (e.g. a
fixed system image, or a re-asked frame) reuses its blocks and a different image never does.

Why partial encoding: after a prefix hit only the image tokens past the hit need features, and an
image entirely inside the hit need not go through the vision tower at all.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ..model.vision import VisionFeatures
from ..processing import ImageBatch


def image_keys(batch: ImageBatch | None) -> list[str]:
    """One content key per image (the preprocessor's digest of its resized pixels and grid)."""
    return [] if batch is None else ["img:" + digest for digest in batch.digests]


def token_extra_keys(
    ids: Sequence[int], image_pad: int, keys: Sequence[str], counts: Sequence[int]
) -> list[Hashable | None]:
    """Per-token extra keys: the owning image's hash for each image-pad token, None for other tokens.

    The pads of ``ids`` belong to the images in order, ``counts[i]`` pads each.
    """
    owner: list[str] = [key for key, n in zip(keys, counts, strict=True) for _ in range(n)]
    out: list[Hashable | None] = []
    pad_index = 0
    for t in ids:
        if t == image_pad and pad_index < len(owner):
            out.append(owner[pad_index])
            pad_index += 1
        else:
            out.append(None)
    return out


def encode_needed(model: torch.nn.Module, batch: ImageBatch, skip_tokens: int) -> VisionFeatures | None:
    """Vision features for the image-pad tokens after the first ``skip_tokens`` of them (None if none).

    Images whose tokens all lie in the skipped part are not encoded.
    """
    counts = list(batch.num_tokens)
    total = sum(counts)
    if skip_tokens >= total:
        return None
    first, start_tokens, start_patches = 0, 0, 0
    patches = batch.grid_thw.prod(-1).tolist()
    while start_tokens + counts[first] <= skip_tokens:
        start_tokens += counts[first]
        start_patches += patches[first]
        first += 1
    device = next(model.parameters()).device
    features = model.encode_images(batch.pixel_values[start_patches:].to(device), batch.grid_thw[first:].to(device))
    offset = skip_tokens - start_tokens
    return features if offset == 0 else features.rows(offset, len(features))
