"""A static decode step (what a CUDA graph captures on a GPU) driven eagerly on the CPU with the harness's
kernels: the tests that compare two ways of running the step (the KV sink against the write launch, the GEMV
epilogues against the separate launches) run the same sequences through it."""

from __future__ import annotations

import torch
from torch import nn

from orin_vlm_node.engine.decode_step import StaticDecodeStep
from orin_vlm_node.kvcache import KVCacheConfig, PagedKVCache
from orin_vlm_node.model import mrope_positions

PROMPTS = (5, 9, 3)  # three sequences of different lengths: a bucket of four, one padding row; pages of 4


def run_static_decode(
    model: nn.Module,
    dtype: torch.dtype,
    attention_impl,
    launched: list[str],
    steps: int,
    prompts: tuple[int, ...] = PROMPTS,
) -> tuple[list[torch.Tensor], torch.Tensor, list[list[str]]]:
    """Prefill prompts of the lengths ``prompts`` (three by default) into a fresh paged cache of ``dtype``
    (``attention_impl``; pages of 4, so the steps cross pages), then ``steps`` greedy static decode steps of all of
    them: each step's logits (sequences, vocab), the KV pool after the last, and the kernels each step launched
    (``launched``: a ``RecordingLauncher``'s list, cleared before each step)."""
    cfg = model.config.text
    cache = PagedKVCache(
        KVCacheConfig(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, page_size=4, kv_pool_blocks=32,
            max_context_tokens=64, prefix_caching=False,
        ),
        attention_impl=attention_impl,
    )  # fmt: skip
    step = StaticDecodeStep(model, cache, torch.device("cpu"), use_cuda_graph=False, max_batch=4)
    seqs, tokens = [], []
    for n in prompts:
        prompt = torch.arange(10, 10 + n)
        seq = cache.new_sequence()
        positions, _ = mrope_positions(prompt, None, model.config.image_token_id, 2)
        tokens.append(int(model.forward(prompt, positions, cache.step(seq, len(prompt))).argmax(-1)))
        seqs.append(seq)
    logits, kernels = [], []
    for _ in range(steps):
        for seq, token in zip(seqs, tokens, strict=True):
            step.prepare(seq, token, 0)
        launched.clear()
        out = step.run()  # (sequences, vocab): three in the bucket of 4 with one padding row, one alone
        kernels.append(list(launched))
        logits.append(out.clone())
        tokens = out.argmax(-1).tolist()
    return logits, cache.kv_storage.clone(), kernels
