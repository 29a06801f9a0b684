"""Images of one turn: content keys for the prefix cache, and encoding only what must be computed.

Why content keys: two prompts with identical token ids can still differ in KV, because every image
becomes the same run of ``<|image_pad|>`` ids. The prefix cache therefore keys image-pad tokens by a
hash of the preprocessed patches and their grid, so a new session showing the *same* image (e.g. a
fixed system image, or a re-asked frame) reuses its blocks and a different image never does.

Why partial encoding: after a prefix hit only the image tokens past the hit need features, and an
image entirely inside the hit need not go through the vision tower at all; an image seen recently
need not either (:class:`VisionCache`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import torch

from ..model.vision import VisionFeatures
from ..processing import ImageBatch


def image_keys(batch: ImageBatch | None) -> list[str]:
    """One content key per image (the preprocessor's digest of its resized pixels and grid)."""
    return [] if batch is None else ["img:" + digest for digest in batch.digests]


def token_extra_keys(
    ids: Sequence[int], pads: Sequence[int], keys: Sequence[str], counts: Sequence[int], text_before: int = 0
) -> list[Hashable | None]:
    """Per-token extra keys: the owning image's (or frame group's) hash for each pad token (an id of ``pads``:
    image and video pads), None for other tokens.

    The pads of ``ids`` from ``text_before`` on belong to the images in order, ``counts[i]`` pads each
    (earlier ones are generated text: ``model.positions.mrope_positions``).
    """
    owner: list[str] = [key for key, n in zip(keys, counts, strict=True) for _ in range(n)]
    out: list[Hashable | None] = []
    pad_index = 0
    for i, t in enumerate(ids):
        if t in pads and i >= text_before and pad_index < len(owner):
            out.append(owner[pad_index])
            pad_index += 1
        else:
            out.append(None)
    return out


class VisionCache:
    """The vision tower's output for the last ``capacity`` distinct images, keyed by content digest.

    Why: a robot asks several questions about one frame, and on a 2B model the vision tower is most of
    an image prompt's time to first token. A prefix-cache hit covers whole KV blocks only, so when the
    last block of an image is partial the image's remaining tokens still need its features; without
    this cache that meant the whole tower again. Bounded by count (the image size is bounded by the
    preprocessor's ``max_pixels``); each entry holds one image's rows, on the model's device. Features
    of another model or preprocessing are stale: the engine makes a new cache when those change.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, VisionFeatures] = OrderedDict()  # least recently used first
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> VisionFeatures | None:
        features = self._entries.get(key)
        if features is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return features

    def put(self, key: str, features: VisionFeatures) -> None:
        if self.capacity <= 0:
            return
        self._entries[key] = features
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def stats(self) -> dict[str, int]:
        return {"images": len(self), "capacity": self.capacity, "hits": self.hits, "misses": self.misses}


def encode_needed(
    model: torch.nn.Module, batch: ImageBatch, skip_tokens: int, cache: VisionCache
) -> VisionFeatures | None:
    """Vision features for the image-pad tokens after the first ``skip_tokens`` of them (None if none).

    Images whose tokens all lie in the skipped part are not encoded, nor are images ``cache`` holds;
    the others go through the vision tower in one batch and into ``cache``.
    """
    counts = list(batch.num_tokens)
    if skip_tokens >= sum(counts):
        return None
    first, start_tokens = 0, 0
    while start_tokens + counts[first] <= skip_tokens:
        start_tokens += counts[first]
        first += 1
    wanted = range(first, len(counts))
    per_image = {i: cache.get(batch.digests[i]) for i in wanted}
    missing = [i for i in wanted if per_image[i] is None]
    fresh = _encode(model, batch, missing) if missing else None
    row = 0
    for i in missing if cache.capacity > 0 else ():  # with the cache off the batch is used as it came
        one = fresh.rows(row, row + counts[i])
        row += counts[i]
        if len(missing) > 1:  # an entry must not keep the whole batch's storage alive
            one = VisionFeatures(one.embeds.clone(), [d.clone() for d in one.deepstack])
        per_image[i] = VisionFeatures(one.embeds, one.deepstack, (counts[i],))
        cache.put(batch.digests[i], per_image[i])
    if len(missing) == len(wanted):  # nothing came from the cache: the batch as the tower returned it
        features = fresh
    elif len(wanted) == 1:
        features = per_image[first]
    else:
        parts = [per_image[i] for i in wanted]
        features = VisionFeatures(
            torch.cat([p.embeds for p in parts]),
            [torch.cat(level) for level in zip(*(p.deepstack for p in parts), strict=True)],
            tuple(counts[first:]),
        )
    offset = skip_tokens - start_tokens
    return features if offset == 0 else features.rows(offset, len(features))


def _encode(model: torch.nn.Module, batch: ImageBatch, images: list[int]) -> VisionFeatures:
    """The vision tower over images ``images`` (indices into ``batch``, ascending) in one batch."""
    patches = batch.grid_thw.prod(-1).tolist()
    starts = [sum(patches[:i]) for i in range(len(patches))]
    if images == list(range(images[0], images[-1] + 1)):  # one slice of the patch rows, no copy
        pixels = batch.pixel_values[starts[images[0]] : starts[images[-1]] + patches[images[-1]]]
    else:
        pixels = torch.cat([batch.pixel_values[starts[i] : starts[i] + patches[i]] for i in images])
    device = next(model.parameters()).device
    return model.encode_images(pixels.to(device), batch.grid_thw[images].to(device))
