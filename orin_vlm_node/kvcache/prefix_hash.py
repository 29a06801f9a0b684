"""Content keys of full KV blocks for prefix caching.

A block's KV depends on every token before it, so its key chains the parent block's key with its own
token ids (and any extra per-token keys such as the content hash of the image behind image-pad tokens:
the same pad ids carry different KV for different images). blake2b keeps collisions negligible; a hit
is still verified against the stored token ids, extras and parent key before it is used.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Hashable, Sequence

BlockExtras = tuple[tuple[int, object], ...]  # (offset in block, key) for tokens with an extra key


def normalize_tokens(token_ids: Sequence[int]) -> tuple[int, ...]:
    """Token ids as a tuple of ints (accepts lists, tuples, 1-D tensors, numpy arrays)."""
    try:
        return tuple(int(t) for t in token_ids)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"token_ids must be a sequence of ints: {exc}") from exc


def normalize_extra_keys(extra_keys: Sequence[Hashable | None] | None, num_tokens: int) -> tuple | None:
    """Check per-token extra keys (None, or one entry per token: None or an int/str/bytes key)."""
    if extra_keys is None:
        return None
    keys = tuple(extra_keys)
    if len(keys) != num_tokens:
        raise ValueError(f"extra_keys has {len(keys)} entries for {num_tokens} tokens; give one per token")
    for key in keys:
        if key is not None and not isinstance(key, (int, str, bytes)):
            raise ValueError(f"extra key {key!r} must be None, int, str or bytes (e.g. an image content hash)")
    return keys if any(k is not None for k in keys) else None


def block_extras(extra_keys: tuple | None, block_index: int, page_size: int) -> BlockExtras:
    """The extras of one block: (offset, key) pairs for its tokens that have a key."""
    if extra_keys is None:
        return ()
    start = block_index * page_size
    chunk = extra_keys[start : start + page_size]
    return tuple((i, key) for i, key in enumerate(chunk) if key is not None)


def block_hash(parent: bytes | None, tokens: tuple[int, ...], extras: BlockExtras) -> bytes:
    """Chained key of a full block: H(parent key, token ids, extras)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else b"\x00root")
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(array("q", tokens).tobytes())
    for offset, key in extras:
        h.update(offset.to_bytes(4, "little"))
        h.update(type(key).__name__.encode())
        h.update(repr(key).encode())
    return h.digest()
