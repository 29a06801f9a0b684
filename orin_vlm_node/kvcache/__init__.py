"""KV cache: where the keys and values of every sequence live, paged or contiguous.

The engine talks to one interface (:class:`KVCache`), implemented by :class:`PagedKVCache` (block pool,
block tables, prefix caching, copy-on-write) and :class:`ContiguousKVCache` (one preallocated
``max_context_tokens`` slab per sequence, the baseline). Models only ever see a
:class:`~.interface.StepAttention`; they never compute addresses and never branch on the cache kind.

Build::

    cfg = KVCacheConfig(num_layers, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda",
                        page_size=16, num_blocks=None, pool_mb=None,        # explicit sizes, or automatic:
                        sequences=2, prefix_share=0.25, reserve_mb=1024,    # contexts held + prefix share
                        max_context_tokens=4096, prefix_caching=True)
    cache = build_kv_cache(cfg, paged=True, attention_impl=None)  # PagedKVCache or ContiguousKVCache

Per request (``seq`` is an int handle)::

    seq = cache.new_sequence()                                  # contiguous: may raise PoolExhausted
    cached = cache.attach_prefix(seq, prompt_ids, extra_keys)   # tokens reused (< len(prompt)), 0 if none
    attn = cache.step(seq, len(prompt_ids) - cached)            # PoolExhausted here changes nothing
    logits = model.forward(prompt_ids[cached:], positions[:, cached:], attn, ...)
    cache.register_prefix(seq, prompt_ids, extra_keys)          # offer its full blocks for reuse
    while decoding:
        attn = cache.step(seq, 1)                               # eager decode
        ...
    cache.release(seq)

``extra_keys`` is None or one entry per token: None for text, an int/str/bytes content key for tokens
whose KV depends on more than their id (e.g. the image hash for each ``<|image_pad|>`` position), so
the same pad ids with another image never hit.

Other operations: ``length(seq)``; ``ensure_capacity(seq, new_len)`` (reserve ahead, PoolExhausted before
any change); ``fork(seq)`` (shared pages, copy-on-write on the first write into a shared page);
``truncate(seq, new_len)`` (drop a step whose forward was abandoned); ``set_attention_impl(impl)`` (paged:
the tensor backend, e.g. the CUDA kernels; None = torch); ``clear()`` (release everything,
forget cached prefixes: call it after weights change); ``match_prefix(ids, extra_keys)`` (peek, no state
change); ``set_prefix_caching(bool)`` (runtime switch, returns the effective state; always False for
contiguous); ``block_table(seq)``; ``stats()`` (blocks used/free/cached, tokens stored, internal
fragmentation, ``kv_bytes_in_use`` vs ``pool_bytes``, prefix hits/misses); ``kv_storage`` (the one
tensor that holds every K and V; on the CPU in huge pages, :mod:`.storage`). Paged only:
``k_pool(layer)``/``v_pool(layer)``. Both: ``plan`` (the chosen :class:`PoolPlan`, with the reason for its
size). :func:`~.memory.device_memory` says how much memory a pool may take on a device (``MemAvailable`` on
a Jetson, whose GPU shares system memory).

Static (CUDA-graph) decode: the engine keeps its own token/position tensors and one
:class:`StaticDecodeBuffers` (slots, lengths, block-table rows of up to ``batch`` sequences) from
``new_static_decode_buffers(batch)``; the StepAttention from ``static_decode_attention(buffers.rows(b),
width)`` reads only those tensors, so one graph per (batch bucket, context width) can be captured once
and replayed for every decode step of every sequence. Before each capture or replay, outside the graph,
call ``prepare_static_decode(seq, buffers, row)`` for each sequence of the step: it grows the sequence by
one token (allocating a block when crossing a page boundary, copying on write, uploading changed
block-table entries) and refills its row in place (why: docs/architecture.md, "Paging under CUDA
graphs"); ``buffers.pad(n)`` turns the rows after the ``n`` staged ones into padding, which stores nothing
and attends to nothing. The paged static step also offers ``kv_sink(layer, dtype)``: a :class:`KVSink`
(the layer's pools and the slot buffer) for a producer that stores the new K/V itself (the GPU's q/k norm
kernel), which then calls the step with ``k = v = None``.

Attention backends: :class:`PagedKVCache` delegates tensor work to a :class:`PagedAttentionImpl`
(``write_kv`` / ``attend`` / ``attend_decode``, documented in :mod:`.attention`); the torch
:class:`TorchPagedAttention` is the default and :func:`causal_attention` in :mod:`.reference` (HF eager
numerics: fp32 softmax, GQA) is the ground truth for both caches and for kernels. On the CPU both caches
run multi-token steps (prefill pieces) through torch's fused attention kernel (:mod:`.fused_prefill`).

Errors: :class:`PoolExhausted` (out of blocks, nothing changed), :class:`ContextLimitExceeded` (a
ValueError: the sequence would pass ``max_context_tokens``), ValueError for bad arguments.
"""

from .attention import PagedAttentionImpl, TorchPagedAttention
from .base import KVCache, StaticDecodeBuffers
from .config import KVCacheConfig, PoolPlan, check_page_size, plan_pool
from .contiguous import ContiguousKVCache
from .errors import ContextLimitExceeded, KVCacheError, PoolExhausted
from .interface import KVSink, SequencesAttention, StepAttention
from .paged import PagedKVCache
from .reference import causal_attention, masked_decode_attention

__all__ = [
    "ContextLimitExceeded",
    "ContiguousKVCache",
    "KVCache",
    "KVCacheConfig",
    "KVCacheError",
    "KVSink",
    "PagedAttentionImpl",
    "PagedKVCache",
    "PoolExhausted",
    "PoolPlan",
    "SequencesAttention",
    "StaticDecodeBuffers",
    "StepAttention",
    "TorchPagedAttention",
    "build_kv_cache",
    "check_page_size",
    "causal_attention",
    "masked_decode_attention",
    "plan_pool",
]


def build_kv_cache(config: KVCacheConfig, paged: bool, attention_impl: PagedAttentionImpl | None = None) -> KVCache:
    """The paged cache (with ``attention_impl``, None = torch) or the contiguous baseline, behind one interface."""
    if paged:
        return PagedKVCache(config, attention_impl=attention_impl)
    cache = ContiguousKVCache(config)
    cache.set_attention_impl(attention_impl)
    return cache
