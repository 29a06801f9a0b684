"""KV bytes a conversation holds: paged vs contiguous, on the real Qwen3-VL shapes.

    python -m bench.kv_memory [--json] [--config PATH] [--page-size 16] [--max-context 4096]

Figures come from the real cache objects (:class:`PagedKVCache`, :class:`ContiguousKVCache`) with
their pools on the ``meta`` device: the bookkeeping (blocks allocated step by step while the
conversation is prefilled and decoded) and ``stats()`` are exactly what the engine would report, and
the pool tensors have their real shapes and dtype, but no memory is touched, so the 28-layer bf16
shape runs anywhere in well under a second per conversation.

Paged holds whole pages (``ceil(tokens / page_size)`` blocks); contiguous holds one full
``max_context_tokens`` slab per sequence however short the conversation is.
``benchmark_figures()`` returns the same numbers for ``bench/memory.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from orin_vlm_node.kvcache import ContiguousKVCache, KVCacheConfig, PagedKVCache

REPO = Path(__file__).resolve().parent.parent

MODEL_CONFIGS = REPO.parent / "shared" / "model-configs"
DEFAULT_CONFIG = MODEL_CONFIGS / "Qwen3-VL-2B-Instruct.config.json"
CONVERSATION_TOKENS = (50, 500, 4000)
MB = 2**20
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def cache_config_from_model(path: Path, page_size: int = 16, max_context_tokens: int = 4096) -> KVCacheConfig:
    """KV shape of a Qwen3-VL checkpoint config.json, pool sized for one full context on ``meta``."""
    text = json.loads(Path(path).read_text())["text_config"]
    hd = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    return KVCacheConfig(
        num_layers=text["num_hidden_layers"],
        num_kv_heads=text["num_key_value_heads"],
        head_dim=hd,
        dtype=_DTYPES.get(text.get("dtype") or text.get("torch_dtype") or "bfloat16", torch.bfloat16),
        device="meta",
        page_size=page_size,
        max_context_tokens=max_context_tokens,
        prefix_caching=False,
    )


def _hold_conversation(cache, tokens: int) -> dict:
    """Prefill the first 3/4 of the conversation in one step, decode the rest token by token."""
    seq = cache.new_sequence()
    prompt = max(1, tokens * 3 // 4)
    cache.step(seq, prompt)
    for _ in range(tokens - prompt):
        cache.step(seq, 1)
    stats = cache.stats()
    cache.release(seq)
    return stats


def kv_memory_figures(
    config_path: Path = DEFAULT_CONFIG,
    conversation_tokens: tuple[int, ...] = CONVERSATION_TOKENS,
    page_size: int = 16,
    max_context_tokens: int = 4096,
) -> list[dict]:
    """One row per conversation length: bytes in use (paged, contiguous), bytes the tokens need, pool."""
    if max(conversation_tokens) > max_context_tokens:
        raise ValueError(f"conversations up to {max(conversation_tokens)} tokens need max_context >= that")
    cfg = cache_config_from_model(config_path, page_size, max_context_tokens)
    paged, contiguous = PagedKVCache(cfg), ContiguousKVCache(cfg)
    rows = []
    for n in conversation_tokens:
        p, c = _hold_conversation(paged, n), _hold_conversation(contiguous, n)
        assert p["tokens_stored"] == c["tokens_stored"] == n
        rows.append(
            {
                "model": Path(config_path).name.removesuffix(".config.json"),
                "tokens": n,
                "page_size": page_size,
                "max_context_tokens": max_context_tokens,
                "bytes_per_token": cfg.bytes_per_token,
                "tokens_kv_bytes": p["kv_bytes_tokens"],
                "paged_kv_bytes": p["kv_bytes_in_use"],
                "paged_blocks": p["blocks_used"],
                "paged_fragmentation": p["internal_fragmentation"],
                "contiguous_kv_bytes": c["kv_bytes_in_use"],
                "contiguous_fragmentation": c["internal_fragmentation"],
                "paged_over_contiguous": p["kv_bytes_in_use"] / c["kv_bytes_in_use"],
                "pool_bytes": p["pool_bytes"],
            }
        )
    return rows


def benchmark_figures(page_size: int = 16, max_context_tokens: int = 4096) -> dict[str, tuple[str, float, str]]:
    """``{key: (unit, value, description)}`` for every shared Qwen3-VL config present (bench/memory.py)."""
    out: dict[str, tuple[str, float, str]] = {}
    for path in sorted(MODEL_CONFIGS.glob("Qwen3-VL-*.config.json")):
        for row in kv_memory_figures(path, page_size=page_size, max_context_tokens=max_context_tokens):
            key = f"{row['model']}.{row['tokens']}tok"
            what = f"{row['model']}, {row['tokens']}-token conversation"
            out[f"{key}.paged_mb"] = ("MB", row["paged_kv_bytes"] / MB, f"{what}: KV held, paged (page {page_size})")
            out[f"{key}.contiguous_mb"] = (
                "MB",
                row["contiguous_kv_bytes"] / MB,
                f"{what}: KV held, contiguous ({max_context_tokens}-token slab)",
            )
            out[f"{key}.tokens_mb"] = ("MB", row["tokens_kv_bytes"] / MB, f"{what}: KV the tokens need")
            out[f"{key}.paged_over_contiguous"] = ("ratio", row["paged_over_contiguous"], f"{what}: paged / contiguous")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a Qwen3-VL config.json")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=4096)
    args = ap.parse_args(argv)
    if not args.config.is_file():
        print(f"model config not found: {args.config}", file=sys.stderr)
        return 2
    rows = kv_memory_figures(args.config, page_size=args.page_size, max_context_tokens=args.max_context)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    r0 = rows[0]
    print(
        f"{r0['model']}: {r0['bytes_per_token']} KV bytes/token, page {r0['page_size']}, "
        f"contiguous slab {r0['max_context_tokens']} tokens"
    )
    print(f"{'tokens':>7} {'tokens need':>12} {'paged':>10} {'contiguous':>11} {'paged/contig':>13} {'paged frag':>11}")
    for r in rows:
        need, paged, contig = (r[k] / MB for k in ("tokens_kv_bytes", "paged_kv_bytes", "contiguous_kv_bytes"))
        print(
            f"{r['tokens']:>7} {need:>9.2f} MB {paged:>7.2f} MB {contig:>8.2f} MB "
            f"{r['paged_over_contiguous']:>12.1%} {r['paged_fragmentation']:>10.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
