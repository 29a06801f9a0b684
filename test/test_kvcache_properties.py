"""Property-based test of the paged cache's bookkeeping under random operation sequences.

Every written K/V row encodes (token id, position, prefix sum, image key), i.e. what the KV of that
slot depends on in a real decoder, so the checks catch both broken bookkeeping (refcounts, free list,
device tables) and wrong data (a copy-on-write that did not copy, a prefix hit with other content).
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from orin_vlm_node.kvcache import KVCacheConfig, PagedKVCache, PoolExhausted

IMAGE_CODES = {None: 0.0, "imgA": 1.0, "imgB": 2.0}
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=6)
image_st = st.sampled_from([None, "imgA", "imgB"])


def _rows(tokens: list[int], extras: list, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expected (k, v) rows (n, 1, 4) for slots start..start+n-1 of a sequence with these tokens."""
    rows = []
    for i in range(start, start + n):
        rows.append([tokens[i], i, sum(tokens[: i + 1]), sum(IMAGE_CODES[e] for e in extras[: i + 1])])
    k = torch.tensor(rows, dtype=torch.float32).unsqueeze(1)
    return k, -k


class PagedCacheMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.cache: PagedKVCache | None = None
        self.model: dict[int, tuple[list[int], list]] = {}  # seq -> (tokens, extras) whose KV is stored

    @precondition(lambda self: self.cache is None)
    @rule(page_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 24))
    def build(self, page_size, num_blocks):
        cfg = KVCacheConfig(
            num_layers=1,
            num_kv_heads=1,
            head_dim=4,
            page_size=page_size,
            kv_pool_blocks=num_blocks,
            max_context_tokens=48,
        )
        self.cache = PagedKVCache(cfg)

    # -- helpers ---------------------------------------------------------------------------------
    def _snapshot(self):
        c = self.cache
        return ({s: (c.block_table(s), c.length(s)) for s in self.model}, sorted(c.pool.free_blocks()))

    def _append(self, seq: int, tokens: list[int], extras: list) -> bool:
        """Append tokens with their KV; on PoolExhausted check nothing changed and report False."""
        old_tokens, old_extras = self.model[seq]
        all_tokens, all_extras = old_tokens + tokens, old_extras + extras
        if len(all_tokens) > self.cache.config.max_context_tokens:
            return False
        before = self._snapshot()
        try:
            attn = self.cache.step(seq, len(tokens))
        except PoolExhausted:
            assert self._snapshot() == before
            return False
        k, v = _rows(all_tokens, all_extras, len(old_tokens), len(tokens))
        attn(0, torch.zeros(len(tokens), 1, 4), k, v)
        self.model[seq] = (all_tokens, all_extras)
        return True

    # -- rules -----------------------------------------------------------------------------------
    @precondition(lambda self: self.cache is not None)
    @rule(target=seqs, tokens=tokens_st, image=image_st, use_prefix=st.booleans())
    def new_request(self, tokens, image, use_prefix):
        extras = [image if t == 2 else None for t in tokens]  # token 2 plays the image pad
        seq = self.cache.new_sequence()
        self.model[seq] = ([], [])
        if use_prefix:
            peek = self.cache.match_prefix(tokens, extras)
            cached = self.cache.attach_prefix(seq, tokens, extras)
            assert cached == peek and cached < len(tokens)  # whole pages and a shared head
            self.model[seq] = (tokens[:cached], extras[:cached])
            tokens, extras = tokens[cached:], extras[cached:]
        self._append(seq, tokens, extras)
        return seq

    @rule(target=seqs, seq=seqs, more=st.lists(st.integers(0, 2), max_size=4), swap_image=st.booleans())
    def follow_up(self, seq, more, swap_image):
        """A new request whose prompt extends an existing sequence (a conversation's next turn), maybe
        with the other image behind the same pad ids: the case prefix caching exists for, and must refuse."""
        if seq not in self.model or not self.model[seq][0]:
            return -1
        tokens, extras = self.model[seq]
        if swap_image:
            extras = [{"imgA": "imgB", "imgB": "imgA"}.get(e) for e in extras]
        prompt, prompt_extras = tokens + more, extras + [None] * len(more)
        new = self.cache.new_sequence()
        cached = self.cache.attach_prefix(new, prompt, prompt_extras)
        assert cached < len(prompt)
        self.model[new] = (prompt[:cached], prompt_extras[:cached])
        if self._append(new, prompt[cached:], prompt_extras[cached:]):
            self.cache.register_prefix(new, prompt, prompt_extras)
        return new

    @rule(seq=seqs, tokens=tokens_st, image=image_st)
    def append(self, seq, tokens, image):
        if seq in self.model:
            self._append(seq, tokens, [image if t == 2 else None for t in tokens])

    @rule(seq=seqs)
    def static_decode(self, seq):
        if seq not in self.model:
            return
        tokens, extras = self.model[seq]
        if len(tokens) + 1 > self.cache.config.max_context_tokens:
            return
        buffers = self.cache.new_static_decode_buffers()
        before = self._snapshot()
        try:
            self.cache.prepare_static_decode(seq, buffers)
        except PoolExhausted:
            assert self._snapshot() == before
            return
        k, v = _rows(tokens + [1], extras + [None], len(tokens), 1)
        self.cache.static_decode_attention(buffers)(0, torch.zeros(1, 1, 4), k, v)
        self.model[seq] = (tokens + [1], extras + [None])

    @rule(target=seqs, seq=seqs)
    def fork(self, seq):
        if seq not in self.model:
            return -1  # a handle that stays unknown
        child = self.cache.fork(seq)
        self.model[child] = (list(self.model[seq][0]), list(self.model[seq][1]))
        return child

    @rule(seq=seqs)
    def register(self, seq):
        if seq in self.model:
            tokens, extras = self.model[seq]
            self.cache.register_prefix(seq, tokens, extras)

    @rule(seq=seqs, cut=st.integers(0, 12))
    def truncate(self, seq, cut):
        if seq in self.model:
            tokens, extras = self.model[seq]
            n = max(0, len(tokens) - cut)
            self.cache.truncate(seq, n)
            self.model[seq] = (tokens[:n], extras[:n])

    @rule(seq=seqs, extra=st.integers(1, 9))
    def reserve(self, seq, extra):
        if seq in self.model:
            new_len = min(len(self.model[seq][0]) + extra, self.cache.config.max_context_tokens)
            before = self._snapshot()
            try:
                self.cache.ensure_capacity(seq, new_len)
            except PoolExhausted:
                assert self._snapshot() == before

    @rule(seq=consumes(seqs))
    def release(self, seq):
        if seq in self.model:
            self.cache.release(seq)
            del self.model[seq]

    @precondition(lambda self: self.cache is not None)
    @rule(data=st.data())
    def clear(self, data):
        if data.draw(st.integers(0, 9)) == 0:  # rare: it wipes everything the other rules built
            self.cache.clear()
            self.model.clear()

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def bookkeeping_is_consistent(self):
        c = self.cache
        if c is None:
            return
        holders = [0] * c.num_blocks
        for seq, (tokens, _) in self.model.items():
            table = c.block_table(seq)
            assert len(set(table)) == len(table), "a table holds a block twice"
            assert c.length(seq) == len(tokens)
            assert len(table) >= -(-len(tokens) // c.page_size)
            for b in table:
                holders[b] += 1
            # The device table was uploaded (no pending entries) and matches the host table.
            state = c._seqs[seq]
            assert not state.dirty
            dev = state.dev_table.tolist()
            assert dev[: len(table)] == table and all(x == -1 for x in dev[len(table) :])
        free = c.pool.free_blocks()
        assert len(free) == len(set(free)) == c.pool.num_free
        for b in range(c.num_blocks):
            assert c.pool.refcount(b) == holders[b], f"block {b}: refcount != number of tables holding it"
            assert (b in free) == (holders[b] == 0), f"block {b}: free and referenced, or neither"
        for b in c.pool._cached_free:
            assert c.pool.key(b) is not None and holders[b] == 0
        for digest, b in c.pool._by_digest.items():
            assert c.pool.key(b).digest == digest
        stats = c.stats()
        assert stats["blocks_used"] + stats["blocks_free"] == c.num_blocks

    @invariant()
    def every_sequence_reads_its_own_kv(self):
        c = self.cache
        if c is None:
            return
        for seq, (tokens, extras) in self.model.items():
            if not tokens:
                continue
            table = torch.tensor(c.block_table(seq))
            k = c.k_pool(0)[table].flatten(0, 1)[: len(tokens)]
            v = c.v_pool(0)[table].flatten(0, 1)[: len(tokens)]
            k_ref, v_ref = _rows(tokens, extras, 0, len(tokens))
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref), f"sequence {seq} reads foreign KV"

    def teardown(self):
        c = self.cache
        if c is None:
            return
        for seq in list(self.model):
            c.release(seq)
        assert sorted(c.pool.free_blocks()) == list(range(c.num_blocks))
        assert c.stats()["blocks_used"] == 0 and c.stats()["tokens_stored"] == 0


PagedCacheMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPagedCacheProperties = PagedCacheMachine.TestCase
