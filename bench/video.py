"""Video prompts: what a camera's recent past costs in time to first token, and how much of it is the
vision tower.

The same eight 448x448 frames asked about three ways, alternated: as one video (four frame pairs, each a
temporal patch: half the visual tokens of the frames as images), as eight separate images, and the last
frame alone as one image. Prefix caching and the vision cache are off, so every request encodes and
prefills all of it. ``vision_share``: the vision tower's time over the request's TTFT, the tower timed alone
on the same preprocessed patches right after each request. ``sliding``: the question asked again over a
history that moved on by one frame pair, with the vision cache against without it (the pairs seen before
skip the tower; the prefix cache cannot help, the first pair differs).
On the default model (its preprocessor scales the frames down: a small tower and few tokens), and in
full/medium mode on the 2B-shape random checkpoint (bf16) with Qwen3-VL-2B's published preprocessor sizes
(images 65,536 to 16,777,216 pixels, a video's frames together 4,096 to 25,165,824), which keep 448x448.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.context import BenchContext
from bench.section import SectionResult
from bench.stats import alternate, paired_ratio
from bench.timing import GenTiming, run_engine
from bench.vs_transformers import greedy, make_engine

QUESTION = "What changed between the first and the last frame?"
QWEN_IMAGE_PIXELS = (65_536, 16_777_216)  # Qwen3-VL-2B-Instruct's preprocessor_config.json
QWEN_VIDEO_PIXELS = (4_096, 25_165_824)  # its video_preprocessor_config.json


def with_qwen_video_sizes(src: Path, dst: Path) -> Path:
    """``src`` seen through links in ``dst``, with Qwen3-VL's video preprocessor sizes (the random checkpoints'
    are a tenth of them, so the cached 4 GB checkpoint is neither copied nor changed)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "video_preprocessor_config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    video = json.loads((src / "preprocessor_config.json").read_text())
    video["size"] = {"shortest_edge": QWEN_VIDEO_PIXELS[0], "longest_edge": QWEN_VIDEO_PIXELS[1]}
    (dst / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    return dst


def _vision_s(engine, turn) -> float:
    """Seconds the vision tower takes on ``turn``'s images and frame groups (preprocessed once, not timed)."""
    from orin_vlm_node.engine.images import VisionCache, encode_needed

    batch = engine.parts.turns.prepare(turn, None, None, engine.parts.config.max_context_tokens).images
    t0 = time.perf_counter()
    encode_needed(engine.parts.model, batch, 0, VisionCache(0))
    return time.perf_counter() - t0


def _measure(res: SectionResult, prefix: str, engine, frames, repeats: int, warmup: int) -> None:
    from orin_vlm_node.engine import Request, Turn, Video

    turns = {
        "video": Turn(QUESTION, videos=(Video(tuple(frames), tuple(i * 0.5 for i in range(len(frames)))),)),
        "images": Turn(QUESTION, images=tuple(frames)),
        "one_image": Turn(QUESTION, images=(frames[-1],)),
    }
    vision: dict[str, list[float]] = {name: [] for name in turns}

    def ask(name: str) -> GenTiming:
        timing = run_engine(engine, Request(turns[name], greedy(1)))
        vision[name].append(_vision_s(engine, turns[name]))
        return timing

    runs = alternate({name: (lambda name=name: ask(name)) for name in turns}, repeats=repeats, warmup=warmup)
    for name, timings in runs.items():
        ttft = [t.ttft_s for t in timings]
        res.add(f"{prefix}{name}.ttft_s", "s", ttft, f"TTFT, the frames as {name.replace('_', ' ')}", prompt=name)
        share = [v / t for v, t in zip(vision[name][-len(ttft) :], ttft, strict=True)]
        res.add(f"{prefix}{name}.vision_share", "fraction", share, "vision tower time / TTFT", prompt=name)
        res.setup[f"{prefix}{name}_prompt_tokens"] = timings[-1].prompt_tokens
    video, images = [t.ttft_s for t in runs["video"]], [t.ttft_s for t in runs["images"]]
    res.add(f"{prefix}video_vs_images", "ratio", paired_ratio(video, images), "TTFT as a video / as 8 images")
    one = [t.ttft_s for t in runs["one_image"]]
    res.add(f"{prefix}video_vs_one_image", "ratio", paired_ratio(video, one), "TTFT as a video / the last frame")


def _sliding(res: SectionResult, prefix: str, cached, uncached, history, count: int, repeats: int) -> None:
    """A history that moved on by one frame pair between questions: TTFT with the vision cache (the pairs
    seen before skip the tower) against without, alternated; each engine saw the first window before."""
    from orin_vlm_node.engine import Request, Turn, Video

    def window(start: int) -> Request:
        frames = history[start : start + count]
        return Request(Turn(QUESTION, videos=(Video(tuple(frames), tuple(i * 0.5 for i in range(count))),)), greedy(1))

    starts = {"cached": iter(range(0, len(history), 2)), "uncached": iter(range(0, len(history), 2))}
    engines = {"cached": cached, "uncached": uncached}
    for name in engines:
        run_engine(engines[name], window(next(starts[name])))
    runs = alternate(
        {name: (lambda name=name: run_engine(engines[name], window(next(starts[name])))) for name in engines},
        repeats=repeats,
        warmup=0,
    )
    on, off = [t.ttft_s for t in runs["cached"]], [t.ttft_s for t in runs["uncached"]]
    res.add(f"{prefix}sliding.cached.ttft_s", "s", on, "TTFT, the history one pair on, vision cache on", cache="on")
    res.add(f"{prefix}sliding.uncached.ttft_s", "s", off, "the same, vision cache off", cache="off")
    res.add(f"{prefix}sliding.ttft_cut", "fraction", [1 - r for r in paired_ratio(on, off)],
            "1 - TTFT(cache on) / TTFT(cache off) per pair")  # fmt: skip
    res.setup[f"{prefix}sliding_vision_cache"] = cached.parts.vision_cache.stats()


def run(ctx: BenchContext) -> SectionResult:
    cfg = ctx.config
    res = SectionResult("video")
    frames = [ctx.image(*cfg.video_frame_size, seed=10 + i) for i in range(cfg.video_frames)]
    res.setup.update(frames=cfg.video_frames, frame_size=list(cfg.video_frame_size))
    off = dict(prefix_caching=False, vision_cache_images=0, max_context_tokens=16384)
    history = [ctx.image(*cfg.video_frame_size, seed=10 + i) for i in range(cfg.video_frames + 2 * cfg.repeats + 2)]
    model_dir, what = ctx.default_model()
    ctx.log("video: default model")
    uncached = make_engine(model_dir, "fp32", **off)
    _measure(res, "", uncached, frames, cfg.repeats, cfg.warmup)
    cached = make_engine(model_dir, "fp32", **(off | {"vision_cache_images": 64}))
    _sliding(res, "", cached, uncached, history, cfg.video_frames, cfg.repeats)
    res.setup["model"] = what
    missing = ctx.big_checkpoint_missing()
    if missing:
        res.skip_part("2b_bf16", missing)
        return res
    ctx.log("video: 2B-shape checkpoint (bf16)")
    model = with_qwen_video_sizes(ctx.big_checkpoint(), ctx.scratch / "big_qwen_video_sizes")
    sizes = dict(image_min_pixels=QWEN_IMAGE_PIXELS[0], image_max_pixels=QWEN_IMAGE_PIXELS[1])
    big = make_engine(model, "bf16", **off, **sizes)
    _measure(res, "2b_bf16.", big, frames, cfg.big_repeats, cfg.warmup)
    big_cached = make_engine(model, "bf16", **(off | sizes | {"vision_cache_images": 64}))
    _sliding(res, "2b_bf16.", big_cached, big, history, cfg.video_frames, cfg.big_repeats)
    res.setup["2b_checkpoint"] = ctx.big_checkpoint_origin
    return res
