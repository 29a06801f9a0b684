"""Memory: KV bytes of typical conversations (paged vs contiguous, vs the pool) and peak RSS.

1. Measured: the default model answers typical conversations held as sessions (so their KV stays
   resident) on a paged and on a contiguous engine; the caches' own accounting (``describe()['kv_cache']``)
   gives bytes in use (paged: whole blocks; contiguous: a full ``max_context_tokens`` slab per sequence),
   the bytes the tokens need, and the pool size.
2. Projected for the real models: bench/kv_memory.py (the KV cache helper's calculator) on the shared
   Qwen3-VL configs, when present.
3. Peak RSS of a fresh process that loads the engine and answers one image prompt (bench/rss_probe.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import kv_memory
from bench.config import REPO
from bench.context import BenchContext
from bench.section import SectionResult
from bench.timing import run_engine
from bench.vs_transformers import greedy, make_engine

MB = 2**20
# (name, number of user turns, image on the first turn)
CONVERSATIONS = (("one_image_question", 1), ("three_turns_with_image", 3))
FOLLOW_UPS = ("What shape is in the picture?", "What color is it?", "Where is it?")


def _measured(ctx: BenchContext, res: SectionResult, model_dir: Path) -> None:
    from orin_vlm_node.engine.events import Request, Turn

    cfg = ctx.config
    image = ctx.image(*cfg.image_size, seed=4)
    for kind, paged in (("paged", True), ("contiguous", False)):
        engine = make_engine(model_dir, "fp32", prefix_caching=False, use_paged_attention=paged)
        for conv, turns in CONVERSATIONS:
            sid = f"mem-{conv}"
            for t in range(turns):
                req = Request(
                    turn=Turn(text=FOLLOW_UPS[t], images=(image,) if t == 0 else ()),
                    sampling=greedy(cfg.max_new_tokens),
                    session_id=sid,
                )
                run_engine(engine, req)
            kv = engine.describe()["kv_cache"]
            labels = {"conversation": conv, "kv": kind}
            res.add(f"{conv}.{kind}.kv_in_use_mb", "MB", [kv["kv_bytes_in_use"] / MB],
                    f"KV bytes held for the conversation ({kind})", **labels)  # fmt: skip
            if kind == "paged":
                res.add(f"{conv}.tokens_kv_mb", "MB", [kv["kv_bytes_tokens"] / MB],
                        "KV bytes the conversation's tokens need (no padding)", conversation=conv)  # fmt: skip
                res.setup.setdefault("conversation_tokens", {})[conv] = kv["tokens_stored"]
            res.setup.setdefault("pool_mb", {})[kind] = kv["pool_bytes"] / MB
            engine.reset(sid)


def _projected(res: SectionResult) -> None:
    for key, (unit, value, description) in kv_memory.benchmark_figures().items():
        res.add(f"projected.{key}", unit, [float(value)], description)


def _peak_rss(ctx: BenchContext, res: SectionResult, model_dir: Path) -> None:
    h, w = ctx.config.image_size
    cmd = [sys.executable, "-m", "bench.rss_probe", str(model_dir), str(h), str(w),
           str(ctx.config.max_new_tokens), "fp32"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"rss_probe failed ({out.returncode}): {out.stderr[-1500:]}")
    data = json.loads(out.stdout.strip().splitlines()[-1])
    res.add("engine.peak_rss_mb", "MB", [data["peak_rss_mb"]], "peak RSS of a process running the engine alone")
    res.add("engine.rss_after_load_mb", "MB", [data["rss_after_load_mb"]], "RSS after loading the engine")
    res.add("engine.rss_after_import_mb", "MB", [data["rss_after_import_mb"]], "RSS after imports (torch etc.)")


def run(ctx: BenchContext) -> SectionResult:
    res = SectionResult("memory")
    model_dir, what = ctx.default_model()
    ctx.log("memory: KV accounting of typical conversations")
    _measured(ctx, res, model_dir)
    _projected(res)
    ctx.log("memory: peak RSS probe")
    _peak_rss(ctx, res, model_dir)
    res.setup.update(
        model=what,
        conversations={c: t for c, t in CONVERSATIONS},
        summary=(
            f"{what}, fp32, max_context_tokens 4096, page 16. Conversations kept as sessions: "
            + ", ".join(f"{c} ({t} turn{'s' if t > 1 else ''})" for c, t in CONVERSATIONS)
            + ". Peak RSS from a fresh process running one image prompt."
        ),
    )
    return res
