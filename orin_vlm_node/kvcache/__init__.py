"""KV cache: where the keys and values of every sequence live, paged or contiguous.

The engine talks to one interface (:class:`KVCache`), implemented by :class:`PagedKVCache` (block pool,
block tables, prefix caching, copy-on-write) and :class:`ContiguousKVCache` (one preallocated
``max_context_tokens`` slab per sequence, the baseline). Models only ever see a
:class:`~.interface.StepAttention`; they never compute addresses and never branch on the cache kind.

More in docs/modules.md, ``orin_vlm_node/kvcache/__init__.py``.
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


def build_kv_cache(
    config: KVCacheConfig, use_paged_attention: bool, attention_impl: PagedAttentionImpl | None = None
) -> KVCache:
    """The paged cache (with ``attention_impl``, None = torch) or the contiguous baseline, behind one interface."""
    if use_paged_attention:
        return PagedKVCache(config, attention_impl=attention_impl)
    cache = ContiguousKVCache(config)
    cache.set_attention_impl(attention_impl)
    return cache
