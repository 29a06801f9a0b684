"""Prefix caching: reuse of full blocks, exactness of reused KV, image extra keys, LRU, verification."""

from __future__ import annotations

import pytest
import torch

from orin_vlm_node.kvcache import KVCacheConfig, PagedKVCache

LAYERS, NQ, NKV, HD, VOCAB = 2, 4, 2, 8, 64
PAGE = 4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class ToyModel:
    """Two attention layers with residuals: every token's KV depends on all tokens before it (and on the
    image content behind image-pad positions), like the real decoder, so a wrong reuse shows in the KV."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(7)
        hidden = NQ * HD
        self.emb = torch.randn(VOCAB, hidden, generator=gen)
        self.images = {name: torch.randn(hidden, generator=gen) for name in ("imgA", "imgB")}
        self.wq = [torch.randn(hidden, NQ * HD, generator=gen) / hidden**0.5 for _ in range(LAYERS)]
        self.wk = [torch.randn(hidden, NKV * HD, generator=gen) / hidden**0.5 for _ in range(LAYERS)]
        self.wv = [torch.randn(hidden, NKV * HD, generator=gen) / hidden**0.5 for _ in range(LAYERS)]

    def forward(self, tokens: list[int], extra: list | None, attn) -> torch.Tensor:
        h = self.emb[torch.tensor(tokens)]
        if extra is not None:
            for i, key in enumerate(extra):
                if key is not None:
                    h[i] = h[i] + self.images[key]
        L = len(tokens)
        for layer in range(LAYERS):
            q = (h @ self.wq[layer]).view(L, NQ, HD)
            k = (h @ self.wk[layer]).view(L, NKV, HD)
            v = (h @ self.wv[layer]).view(L, NKV, HD)
            h = h + attn(layer, q, k, v).reshape(L, -1)
        return h[-1]


def _cache(num_blocks: int = 32, prefix_caching: bool = True) -> PagedKVCache:
    cfg = KVCacheConfig(
        num_layers=LAYERS,
        num_kv_heads=NKV,
        head_dim=HD,
        page_size=PAGE,
        kv_pool_blocks=num_blocks,
        max_context_tokens=64,
        prefix_caching=prefix_caching,
    )
    return PagedKVCache(cfg)


def _serve(cache: PagedKVCache, model: ToyModel, tokens: list[int], extra: list | None = None):
    """What the engine does for a prompt: attach cached prefix, prefill the rest, register full blocks."""
    seq = cache.new_sequence()
    cached = cache.attach_prefix(seq, tokens, extra)
    rest_extra = None if extra is None else extra[cached:]
    last = model.forward(tokens[cached:], rest_extra, cache.step(seq, len(tokens) - cached))
    cache.register_prefix(seq, tokens, extra)
    return seq, cached, last


def _kv(cache: PagedKVCache, seq: int) -> torch.Tensor:
    """(2, layers, length, nkv, hd) KV the sequence reads, gathered through its block table."""
    table = torch.tensor(cache.block_table(seq))
    return cache.kv_storage[:, :, table].flatten(2, 3)[:, :, : cache.length(seq)]


def _recompute(model: ToyModel, tokens: list[int], extra: list | None = None):
    fresh = _cache(prefix_caching=False)
    seq = fresh.new_sequence()
    last = model.forward(tokens, extra, fresh.step(seq, len(tokens)))
    return _kv(fresh, seq), last


def test_shared_three_block_prefix_allocates_only_new_blocks_and_matches_recompute():
    model, cache = ToyModel(), _cache()
    prompt_a = list(range(1, 18))  # 17 tokens: 4 full blocks + 1
    seq_a, cached_a, _ = _serve(cache, model, prompt_a)
    assert cached_a == 0
    prompt_b = prompt_a[:12] + [40, 41, 42, 43, 44, 45, 46, 47]  # shares exactly blocks 0..2
    assert cache.match_prefix(prompt_b) == 12
    free_before = cache.stats()["blocks_free"]
    seq_b, cached_b, last_b = _serve(cache, model, prompt_b)
    assert cached_b == 12
    assert cache.block_table(seq_b)[:3] == cache.block_table(seq_a)[:3]
    assert free_before - cache.stats()["blocks_free"] == 2  # 5 blocks for 20 tokens, 3 reused
    kv_ref, last_ref = _recompute(model, prompt_b)
    torch.testing.assert_close(_kv(cache, seq_b), kv_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(last_b, last_ref, rtol=1e-6, atol=1e-6)
    stats = cache.stats()
    assert stats["prefix_queries"] == 2 and stats["prefix_hit_blocks"] == 3
    assert stats["prefix_miss_blocks"] == 4 + 1  # request A: 4 lookups missed; request B: block 3 missed


def test_last_token_always_recomputed_and_released_blocks_stay_reusable():
    model, cache = ToyModel(), _cache()
    prompt = list(range(3, 19))  # 16 tokens = exactly 4 full blocks
    seq, _, _ = _serve(cache, model, prompt)
    cache.release(seq)
    assert cache.stats()["blocks_used"] == 0 and cache.stats()["blocks_cached_free"] == 4
    # Same prompt again: the last token must be recomputed, or there would be no logits to sample from;
    # the first three of the last block are the cached block's head.
    seq2, cached, last = _serve(cache, model, prompt)
    assert cached == 15
    _, last_ref = _recompute(model, prompt)
    torch.testing.assert_close(last, last_ref, rtol=1e-6, atol=1e-6)
    # The longer conversation (prompt + generated tokens) reuses all four blocks.
    assert cache.match_prefix(prompt + [50]) == 16
    cache.release(seq2)


def test_different_image_with_same_token_ids_never_hits():
    model, cache = ToyModel(), _cache()
    pad = 9
    tokens = [1, 2, 3, 4] + [pad] * 8 + [5, 6, 7, 8, 10]  # text block, two image blocks, text
    extra_a = [None] * 4 + ["imgA"] * 8 + [None] * 5
    extra_b = [None] * 4 + ["imgB"] * 8 + [None] * 5
    _serve(cache, model, tokens, extra_a)
    assert cache.match_prefix(tokens, extra_a) == 16
    assert cache.match_prefix(tokens, extra_b) == 4  # only the text block before the image
    assert cache.match_prefix(tokens) == 4  # no extra keys at all: not the image-A blocks either
    seq_b, cached_b, last_b = _serve(cache, model, tokens, extra_b)
    assert cached_b == 4
    kv_ref, last_ref = _recompute(model, tokens, extra_b)
    torch.testing.assert_close(_kv(cache, seq_b), kv_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(last_b, last_ref, rtol=1e-6, atol=1e-6)


def test_lru_evicts_tail_blocks_of_the_oldest_release_first():
    model, cache = ToyModel(), _cache(num_blocks=8)
    prompt = list(range(20, 37))  # 17 tokens: 5 blocks, 4 full ones registered
    seq, _, _ = _serve(cache, model, prompt)
    cache.release(seq)
    assert cache.stats()["blocks_cached_free"] == 4
    other = cache.new_sequence()
    cache.ensure_capacity(other, 6 * PAGE)  # 4 never-cached free blocks + 2 evictions
    assert cache.stats()["evictions"] == 2
    assert cache.match_prefix(prompt) == 2 * PAGE  # the head of the prefix survived
    cache.release(other)


def test_hash_collision_is_caught_by_token_verification(monkeypatch):
    import orin_vlm_node.kvcache.paged as paged

    monkeypatch.setattr(paged, "block_hash", lambda parent, tokens, extras: b"same-digest-for-all")
    model, cache = ToyModel(), _cache()
    _serve(cache, model, [1, 2, 3, 4, 5])
    assert cache.match_prefix([1, 2, 3, 4, 5]) == 4
    assert cache.match_prefix([9, 9, 9, 9, 5]) == 0


def test_register_needs_written_kv_and_extra_keys_per_token():
    cache = _cache()
    seq = cache.new_sequence()
    cache.step(seq, 3)
    with pytest.raises(ValueError, match="holds KV for 3"):
        cache.register_prefix(seq, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="one per token"):
        cache.register_prefix(seq, [1, 2, 3], ["x"])
    with pytest.raises(ValueError, match="int, str or bytes"):
        cache.match_prefix([1, 2], [None, 1.5])
    with pytest.raises(ValueError, match="empty sequence"):
        cache.attach_prefix(seq, [1, 2, 3])


def test_prefix_caching_switch():
    model, cache = ToyModel(), _cache()
    prompt = list(range(1, 10))
    seq, _, _ = _serve(cache, model, prompt)
    assert cache.match_prefix(prompt) == 8
    assert cache.set_prefix_caching(False) is False
    assert cache.match_prefix(prompt) == 0 and cache.stats()["blocks_cached"] == 0
    assert cache.set_prefix_caching(True) is True
    assert cache.match_prefix(prompt) == 0  # keys were dropped; registering again restores them
    cache.register_prefix(seq, prompt)
    assert cache.match_prefix(prompt) == 8


@pytest.mark.parametrize("forked", [False, True])
def test_rewriting_a_cached_block_after_truncate_never_corrupts_the_index(forked):
    """A truncated sequence that writes new tokens into a registered block must not leave the old key
    pointing at new content: a block held alone loses its key, a shared one is copied first."""
    model, cache = ToyModel(), _cache()
    prompt = list(range(1, 10))  # 9 tokens: blocks 0 and 1 registered
    seq, _, _ = _serve(cache, model, prompt)
    other = cache.fork(seq) if forked else None
    cache.truncate(seq, 6)  # back inside block 1
    rewritten = prompt[:6] + [50, 51, 52]
    model.forward(rewritten[6:], None, cache.step(seq, 3))
    cache.register_prefix(seq, rewritten)
    # Forked: the old block 1 stayed cached for the fork. Alone: it lost its key, and what is left of the
    # prompt's block 1 in the cache is the head the rewrite kept ([5, 6]).
    assert cache.match_prefix(prompt) == (8 if forked else 6)
    assert cache.match_prefix(rewritten + [60]) == 8
    fresh, cached, last = _serve(cache, model, prompt)
    _, last_ref = _recompute(model, prompt)
    torch.testing.assert_close(last, last_ref, rtol=1e-6, atol=1e-6)
    if other is not None:
        assert cache.block_table(other)[1] != cache.block_table(seq)[1]


@pytest.mark.parametrize("held", [False, True])
def test_a_new_question_reuses_the_shared_head_of_a_cached_block_and_leaves_it_intact(held):
    """A robot's next question about the same image: the page holding the image's end also held the last
    question's start. Its shared head is reused (the prompt's KV equals a recompute); writing the rest of
    the page copies the block when another sequence holds it, else takes it over (its key dropped), so the
    cached content is never overwritten while findable."""
    model, cache = ToyModel(), _cache()
    pad = 9
    image = [1, 2] + [pad] * 7  # text, then an image ending inside block 2
    extra = [None] * 2 + ["imgA"] * 7
    first = image + [20, 21, 22, 23, 24]  # 14 tokens: blocks 0..2 full and registered
    second = image + [30, 31, 32, 33]  # shares 9 tokens: blocks 0, 1 and one token of block 2
    seq_a, _, _ = _serve(cache, model, first, extra + [None] * 5)
    if not held:
        cache.release(seq_a)
    cached_block = cache.block_table(seq_a)[2] if held else None
    kv_before = _kv(cache, seq_a).clone() if held else None
    assert cache.match_prefix(second, extra + [None] * 4) == 9
    assert cache.match_prefix(second, extra[:-1] + ["imgB"] + [None] * 4) == 8  # other image: not its token
    seq_b, cached, last_b = _serve(cache, model, second, extra + [None] * 4)
    assert cached == 9 and cache.stats()["prefix_hit_tokens"] == 9
    kv_ref, last_ref = _recompute(model, second, extra + [None] * 4)
    torch.testing.assert_close(_kv(cache, seq_b), kv_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(last_b, last_ref, rtol=1e-6, atol=1e-6)
    if held:  # copied: the first sequence still reads its own block 2, unchanged and still cached
        assert cache.block_table(seq_b)[2] != cached_block
        torch.testing.assert_close(_kv(cache, seq_a), kv_before, rtol=0, atol=0)
        assert cache.match_prefix(first, extra + [None] * 5) == 12
    else:  # taken over: the old key is gone, the new content is offered under its own
        assert cache.match_prefix(first, extra + [None] * 5) == 9
        assert cache.match_prefix(second + [40], extra + [None] * 5) == 12
