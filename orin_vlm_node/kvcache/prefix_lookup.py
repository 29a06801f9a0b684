"""Looking a prompt up in the prefix cache: the longest verified chain of cached full blocks, then the cached
block that shares the most of the next tokens (a partial page). Keys are verified against the content they
were computed from, so a digest collision never serves KV of other content."""

from __future__ import annotations

from .block_pool import BlockPool
from .prefix_hash import block_extras, block_hash


def find_prefix(
    pool: BlockPool, page_size: int, tokens: tuple[int, ...], extras: tuple | None
) -> tuple[list[tuple[int, bytes]], int, tuple[int, int] | None]:
    """Longest verified chain of cached blocks for this prompt, leaving the last token uncached; the
    full blocks (block, digest), how many full blocks the prompt has to look up, and the cached block
    that shares the most of the next tokens (block, tokens shared) or None.

    Why the partial block: a robot asks new questions about the same system prompt and image, and the
    page that holds the image's end holds the previous question's start too, so whole pages alone
    would leave up to a page of the shared prompt to recompute. The shared head of such a page is
    reused as it is: the sequence holds the block and, when its prefill writes the rest of the page,
    copy-on-write (or, for a block nobody else holds, dropping its key) keeps the cached content intact.
    """
    max_full = (len(tokens) - 1) // page_size if tokens else 0
    hits: list[tuple[int, bytes]] = []
    parent: bytes | None = None
    p = page_size
    for i in range(max_full):
        blk = tokens[i * p : (i + 1) * p]
        ex = block_extras(extras, i, p)
        digest = block_hash(parent, blk, ex)
        block = pool.lookup(digest)
        if block is None:
            break
        key = pool.key(block)
        if key is None or key.tokens != blk or key.extras != ex or key.parent != parent:
            break  # digest collision: never serve KV computed from other content
        hits.append((block, digest))
        parent = digest
    return hits, max_full, _partial_block(pool, page_size, tokens, extras, len(hits), parent)


def _partial_block(
    pool: BlockPool, page_size: int, tokens: tuple[int, ...], extras: tuple | None, index: int, parent: bytes | None
) -> tuple[int, int] | None:
    """The cached block after ``parent`` whose tokens (and extra keys) agree longest with the prompt's
    block ``index``, and how many tokens agree (at most all but the prompt's last token); None if none."""
    p = page_size
    head = tokens[index * p : (index + 1) * p]
    limit = min(len(head), len(tokens) - index * p - 1)
    wanted = dict(block_extras(extras, index, p))
    best: tuple[int, int] | None = None
    for block in pool.children(parent):
        key = pool.key(block)
        have = dict(key.extras)
        n = 0
        while n < limit and key.tokens[n] == head[n] and have.get(n) == wanted.get(n):
            n += 1
        if n and (best is None or n > best[1]):
            best = (block, n)
    return best
