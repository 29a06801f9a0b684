"""Engine vs transformers on the same checkpoint, prompt and image, in one process, alternating repeats.

For every checkpoint (the default model; the 2B-shape random checkpoint in bf16 and fp32) and prompt
(text only; one image) both implementations run greedy answers of a fixed length (``ignore_eos`` on
both sides: EOS is generated like any token, so the tokens still match): engine, transformers,
transformers, engine, ... so machine noise hits both sides alike. Ratios are per pair:
``ttft_ratio = engine / transformers`` (lower is better) and ``decode_ratio = engine / transformers``
tokens/s (higher is better). A decode figure needs an answer of at least ``MIN_DECODE_TOKENS`` (shorter
ones are dominated by per-request noise); the 2B image prompt measures TTFT only, its decode is the
text prompt's GEMVs again at minutes per answer. Both load the same files; the 2B checkpoint is built
once, bf16 on disk, and loaded as fp32 for the fp32 run.
"""

from __future__ import annotations

import gc
from functools import partial
from pathlib import Path

import torch

from bench.context import BenchContext
from bench.section import SectionResult
from bench.stats import alternate, paired_ratio
from bench.timing import GenTiming, HFRunner, run_engine

TEXT_PROMPT = "Describe what a robot arm does when it picks up the red cube and places it on the table."
IMAGE_PROMPT = "Describe this image in detail."
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MIN_DECODE_TOKENS = 64


def mem_available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def make_engine(model_dir: Path, dtype: str, **overrides):
    from orin_vlm_node.engine import Engine
    from orin_vlm_node.engine.config import EngineConfig

    config = {"model_path": str(model_dir), "device": "cpu", "dtype": dtype, "max_batch": 1} | overrides
    return Engine(EngineConfig(**config))  # one request at a time, like transformers' generate


def greedy(max_new_tokens: int, ignore_eos: bool = False):
    """Greedy sampling; ``ignore_eos``: exactly ``max_new_tokens`` tokens."""
    from orin_vlm_node.engine.events import SamplingParams

    return SamplingParams(
        temperature=0.0, max_new_tokens=max_new_tokens, repetition_penalty=1.0, ignore_eos=ignore_eos or None
    )


def compare(
    ctx: BenchContext,
    res: SectionResult,
    name: str,
    model_dir: Path,
    dtype: str,
    max_new_tokens: dict[str, int],
    repeats: int,
    image_hw: tuple[int, int],
    ttft_repeats: int = 0,
) -> None:
    """Load both implementations on ``model_dir`` and record the figures of ``name``.{text,image};
    ``max_new_tokens``: the answer length of each prompt. ``ttft_repeats``: TTFT figures from that many
    further alternating pairs of one-token answers (a TTFT costs milliseconds on a small model, where a
    handful of pairs leaves the median to one slow pair); 0 = from the TTFTs of the ``repeats`` answers."""
    from orin_vlm_node.engine.events import Request, Turn

    ctx.log(f"vs_transformers[{name}]: loading engine and transformers ({dtype})")
    engine = make_engine(model_dir, dtype, prefix_caching=False)
    hf = HFRunner(str(model_dir), TORCH_DTYPES[dtype])
    res.setup.setdefault("hf_attn_implementation", hf.attn_implementation)
    image = ctx.image(*image_hw, seed=1)
    try:
        for prompt, text, images in (("text", TEXT_PROMPT, ()), ("image", IMAGE_PROMPT, (image,))):
            counter = iter(range(10**6))
            n = max_new_tokens[prompt]

            def eng(text=text, images=images, counter=counter, n=n) -> GenTiming:
                req = Request(
                    turn=Turn(text=text, images=images),
                    sampling=greedy(n, ignore_eos=True),
                    request_id=f"bench-{name}-{next(counter)}",
                )
                return run_engine(engine, req)

            def ref(text=text, images=images, n=n) -> GenTiming:
                return hf.run(text, images, None, n, ignore_eos=True)

            sides = {"engine": eng, "hf": ref}
            ctx.log(f"vs_transformers[{name}.{prompt}]: {repeats} alternating repeats")
            runs = alternate(sides, repeats=repeats, warmup=ctx.config.warmup)
            e, h = runs["engine"], runs["hf"]
            key = f"{name}.{prompt}"
            labels = {"model": name, "prompt": prompt}
            te, th = e, h
            if ttft_repeats:
                ctx.log(f"vs_transformers[{name}.{prompt}]: {ttft_repeats} alternating one-token pairs for TTFT")
                first = alternate(
                    {"engine": partial(eng, n=1), "hf": partial(ref, n=1)}, repeats=ttft_repeats, warmup=0
                )
                te, th = first["engine"], first["hf"]
            _ttft_figures(res, key, labels, te, th)
            if n >= MIN_DECODE_TOKENS:
                _decode_figures(res, key, labels, e, h, n)
            else:
                res.notes.append(f"{key}: {n}-token answers, no decode figure (needs {MIN_DECODE_TOKENS}+)")
            same = e[-1].token_ids == h[-1].token_ids
            res.setup.setdefault("runs", {})[key] = {
                "dtype": dtype,
                "prompt_tokens_engine": e[-1].prompt_tokens,
                "prompt_tokens_hf": h[-1].prompt_tokens,
                "generated_tokens_engine": len(e[-1].token_ids),
                "generated_tokens_hf": len(h[-1].token_ids),
                "same_tokens": same,
                "image_hw": list(image_hw) if images else None,
            }
            if not same:
                res.notes.append(
                    f"{key}: greedy tokens differ between engine and transformers "
                    f"(engine {list(e[-1].token_ids)[:12]}..., hf {list(h[-1].token_ids)[:12]}...)"
                )
    finally:
        engine = hf = None
        gc.collect()


def _ttft_figures(res: SectionResult, key: str, labels: dict[str, str], e: list[GenTiming], h: list[GenTiming]) -> None:
    """TTFT of both sides and their per-pair ratio."""
    res.add(f"{key}.engine.ttft_s", "s", [r.ttft_s for r in e], "engine time to first token", impl="engine", **labels)
    res.add(f"{key}.hf.ttft_s", "s", [r.ttft_s for r in h], "transformers time to first token", impl="hf", **labels)
    res.add(
        f"{key}.ttft_ratio",
        "x",
        paired_ratio([r.ttft_s for r in e], [r.ttft_s for r in h]),
        "engine TTFT / transformers TTFT (per alternating pair; lower is better)",
        **labels,
    )


def _decode_figures(
    res: SectionResult, key: str, labels: dict[str, str], e: list[GenTiming], h: list[GenTiming], n: int
) -> None:
    """Decode rates of both sides and their per-pair ratio, from answers of ``n`` tokens."""
    res.add(f"{key}.engine.decode_tok_s", "tok/s", [r.decode_tok_s for r in e], f"engine decode, {n}-token answers",
            impl="engine", **labels)  # fmt: skip
    res.add(f"{key}.hf.decode_tok_s", "tok/s", [r.decode_tok_s for r in h],
            f"transformers decode, {n}-token answers", impl="hf", **labels)  # fmt: skip
    res.add(
        f"{key}.decode_ratio",
        "x",
        paired_ratio([r.decode_tok_s for r in e], [r.decode_tok_s for r in h]),
        "engine decode tok/s / transformers decode tok/s (per pair; higher is better)",
        **labels,
    )


def run(ctx: BenchContext) -> SectionResult:
    cfg = ctx.config
    res = SectionResult("vs_transformers")
    res.setup["torch_threads"] = torch.get_num_threads()
    res.setup["engine_config"] = dict(prefix_caching=False, device="cpu")
    default_tokens = {"text": cfg.max_new_tokens, "image": cfg.max_new_tokens}
    big_tokens = {"text": cfg.big_max_new_tokens, "image": cfg.big_image_max_new_tokens}
    res.setup["max_new_tokens"] = {"default": default_tokens, "2b": big_tokens}
    model_dir, what = ctx.default_model()
    res.setup["default_model"] = what
    res.setup["ttft_repeats"] = {"default": cfg.ttft_repeats, "2b": 0}
    compare(ctx, res, "default", model_dir, "fp32", default_tokens, cfg.repeats, cfg.image_size, cfg.ttft_repeats)

    missing = ctx.big_checkpoint_missing()
    if missing:
        for dt in cfg.big_dtypes:
            res.skip_part(f"2b_{dt}", missing)
    else:
        big = ctx.big_checkpoint()
        res.setup["2b_checkpoint"] = (
            f"random weights, every dimension of Qwen3-VL-2B-Instruct (bf16 on disk); {ctx.big_checkpoint_origin}"
        )
        for dt in cfg.big_dtypes:
            # Engine and transformers hold one copy each: 2 x 2.1e9 params x element size, plus headroom.
            need = 2 * 2.13e9 * TORCH_DTYPES[dt].itemsize + 2 * 2**30
            avail = mem_available_bytes()
            if avail < need:
                res.skip_part(
                    f"2b_{dt}", f"needs ~{need / 2**30:.1f} GiB free memory, {avail / 2**30:.1f} GiB available"
                )
                continue
            compare(ctx, res, f"2b_{dt}", big, dt, big_tokens, cfg.big_repeats, cfg.big_image_size)
    res.setup["summary"] = (
        f"{what}; 2B-shape random checkpoint ({', '.join(cfg.big_dtypes) if cfg.big_checkpoint else 'not run'}); "
        f"greedy, same prompt/image both sides, {cfg.repeats} alternating repeats after {cfg.warmup} warm-up "
        f"(default model TTFT: {cfg.ttft_repeats} further pairs of one-token answers); "
        f"transformers attention: {res.setup.get('hf_attn_implementation', '?')}; "
        f"{torch.get_num_threads()} torch threads. Engine on CPU (dynamic decode step)."
    )
    return res
