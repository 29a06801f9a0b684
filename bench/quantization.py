"""Weight-only quantization: what INT8 and INT4 weights cost in accuracy, and what they save in memory.

* Default model (trained, embedded): greedy exact match on the 200 held-out samples of its task with
  ``weight_quant`` none / int8 / int4 (goals: int8 within 1 point, int4 within 3 points of none).
* 2B-shape random checkpoint (full/medium mode): the model's own greedy continuation of a prompt (64
  tokens, fp32 weights) is fed once through each quantized model (teacher forcing); per position, the
  logit error relative to the fp32 logits' spread and whether the top token agrees.
* Weight bytes per mode, as a share of the same model with every weight in fp16: the decoder projections
  alone (what the mode sets) and the whole model (the LM head in int8, a tied one as a copy beside the
  embedding table; embeddings, norms and the vision tower in fp16).

* Default model stored as FP8 (written by ``support.quantized_copies.fp8_copy``; Qwen's ``-FP8`` layout, e4m3
  weights with a scale per 128x128 block, and llm-compressor's FP8_DYNAMIC one, a scale per output
  channel): held-out exact match of the widened model, and with ``int4`` on top (goal: within 1 point of
  the float checkpoint without int4, like int8: FP8 keeps 3 mantissa bits per weight).
* Default model stored as integers (``support.quantized_copies.int_copy``: compressed-tensors' W4A16 and
  W4A16_ASYM, group 128, and W8A16 per channel, round to nearest; the vision tower in float), read with the
  ``weight_quant`` that keeps the stored values (goals: the 4-bit copies within 3 points of the float
  checkpoint, the 8-bit one within 1, as the node's own int4 and int8); and as AutoAWQ's GEMM layout and
  GPTQ's own format save 4-bit weights (``support.quantized_copies.awq_copy``, ``gptq_copy``: group 128, AWQ with
  zero points, GPTQ symmetric, round to nearest), read with ``int4`` (goal: within 3 points).

* Loading the 2B shape as int4 (fresh processes, alternating, one thread): from the bf16 checkpoint,
  quantized while it streams in, against W4A16, AutoAWQ and GPTQ copies kept as stored; seconds and peak
  RSS. No goal.

* CPU decode speed per mode on the 2B-shape checkpoint (fp32 activations, the CPU GEMM kernels reading the
  stored int8 / int4 weights): tokens/s of fixed-length answers, and each as a ratio to ``none``. No goal
  is set on it; the speed goals are the GPU section's.
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.config import REPO
from bench.context import BenchContext
from bench.section import SectionResult
from bench.timing import run_engine
from bench.vs_transformers import greedy, make_engine

MODES = ("none", "int8", "int4")
BIG_TOKENS = 64
BIG_PROMPT = "Describe what the robot sees in front of it and what it should do next."
SPEED_TOKENS = 16  # per timed answer on the 2B-shape checkpoint (about a third of a second each on one core)
SPEED_REPEATS = 3  # timed answers per mode, after one warm-up
# FP8 copies of the default model: Qwen's -FP8 layout (128x128 blocks) and llm-compressor's FP8_DYNAMIC one
# (a scale per output channel); each read with weight_quant none and int4.
FP8_COPIES = {"fp8": {"block": (128, 128)}, "fp8_channel": {"block": None, "compressed_tensors": "channel"}}
FP8_MODES = ("none", "int4")
LOAD_GROUP = 128  # int4 group of the 2B-shape load comparison (the default, and llm-compressor's W4A16)
LOAD_REPEATS = 2  # fresh-process loads per checkpoint, alternating (about a minute each from bf16)
# Integer copies of the default model as llm-compressor saves its W4A16 / W4A16_ASYM / W8A16 schemes
# (compressed-tensors, round to nearest, the vision tower left in float), each read with the weight_quant that
# keeps the stored values.
INT_COPIES = {
    "w4a16": ({"bits": 4, "group_size": 128, "symmetric": True}, "int4"),
    "w4a16_asym": ({"bits": 4, "group_size": 128, "symmetric": False}, "int4"),
    "w8a16": ({"bits": 8, "strategy": "channel", "group_size": None, "symmetric": True}, "int8"),
}
HUB_GROUP = 128  # the AutoAWQ and GPTQ copies: the group size both tools default to


def _exact_match(model_dir: Path, mode: str, held_out: int) -> tuple[float, float]:
    """(share of the first ``held_out`` held-out answers exactly right, weight MB) with ``weight_quant=mode``."""
    from orin_vlm_node.engine.events import Request, Turn
    from support import synthetic_scenes as scenes

    engine = make_engine(model_dir, "fp32", weight_quant=mode, kv_pool_blocks=64, max_context_tokens=1024)
    hits = 0
    samples = scenes.held_out_samples(held_out)
    for s in samples:
        images = (s.image,) if s.image is not None else ()
        final = list(engine.generate(Request(Turn(s.question, images), greedy(24))))[-1]
        hits += final.text.strip() == s.answer
    return hits / len(samples), engine.describe()["weight_mb"]


def _projection_bytes(model) -> tuple[int, int]:
    """(bytes of the decoder projections as stored, their weight count)."""
    from orin_vlm_node.weights.quant import QuantizedLinear
    from orin_vlm_node.weights.sites import projection_sites

    stored = count = 0
    for site in projection_sites(model).values():
        if site.is_head:
            continue
        module = site.module
        # A quantized projection, or one the CPU kernels wrap (CpuQuantLinear holds it as a child).
        quantized = [m for m in module.modules() if isinstance(m, QuantizedLinear)]
        if quantized:
            stored += sum(m.nbytes for m in quantized)
            count += sum(m.in_features * m.out_features for m in quantized)
        else:  # a float projection (nn.Linear, or CpuLinear on the CPU kernels): its one weight parameter
            stored += sum(p.numel() * p.element_size() for p in module.parameters())
            count += sum(p.numel() for p in module.parameters())
    return stored, count


def _teacher_forced_logits(engine, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) logits of every position of ``ids`` in one forward (positions 0..n-1, no image)."""
    cache = engine.parts.cache
    seq = cache.new_sequence()
    try:
        with torch.inference_mode():
            positions = torch.arange(len(ids)).expand(3, -1)
            step = cache.step(seq, len(ids))
            return engine.parts.model.forward(torch.tensor(ids), positions, step, logits_index=torch.arange(len(ids)))
    finally:
        cache.release(seq)


def _decode_tok_s(engine) -> list[float]:
    """Decode tokens/s of ``SPEED_REPEATS`` fixed-length answers to the 2B prompt, after a warm-up."""
    from orin_vlm_node.engine.events import Request, Turn

    def answer(i: int) -> float:
        request = Request(Turn(BIG_PROMPT), greedy(SPEED_TOKENS, ignore_eos=True), request_id=f"speed-{i}")
        return run_engine(engine, request).decode_tok_s

    answer(0)
    return [answer(i + 1) for i in range(SPEED_REPEATS)]


def _big(ctx: BenchContext, res: SectionResult) -> None:
    from orin_vlm_node.engine.events import Request, Turn
    from orin_vlm_node.weights.quant import QuantizedLinear, weight_bytes

    path = ctx.big_checkpoint()
    engine = make_engine(path, "fp32", max_context_tokens=512)
    prompt = engine.parts.turns.prepare(Turn(BIG_PROMPT), None, None, 512).new_ids  # what generate prefills
    final = list(engine.generate(Request(Turn(BIG_PROMPT), greedy(BIG_TOKENS, ignore_eos=True))))[-1]
    ids = list(prompt) + list(final.token_ids)
    reference = _teacher_forced_logits(engine, ids)[len(prompt) - 1 : -1]  # the logits that chose each token
    chosen = torch.tensor(final.token_ids)
    _, count = _projection_bytes(engine.parts.model)
    total = weight_bytes(engine.parts.model) // 4  # weights of the fp32 model
    speed = {"none": _decode_tok_s(engine)}
    res.add("2b.none.decode_tok_s", "tok/s", speed["none"],
            f"CPU decode, fp32 weights, {SPEED_TOKENS}-token answers", mode="none")  # fmt: skip
    engine = None
    gc.collect()
    spread = reference.std(dim=-1, keepdim=True)  # (T, 1)
    for mode in MODES[1:]:
        engine = make_engine(path, "fp32", max_context_tokens=512, weight_quant=mode)
        logits = _teacher_forced_logits(engine, ids)[len(prompt) - 1 : -1]
        error = ((logits - reference).abs().amax(dim=-1, keepdim=True) / spread).squeeze(-1)
        agree = (logits.argmax(dim=-1) == chosen).float()
        stored, _ = _projection_bytes(engine.parts.model)
        quantized = sum(m.nbytes for m in engine.parts.model.modules() if isinstance(m, QuantizedLinear))
        as_fp16 = (weight_bytes(engine.parts.model) - quantized) // 2 + quantized  # the float weights are fp32 here
        res.add(f"2b.{mode}.logit_error", "x spread", error.tolist(),
                "per token: max |logit - fp32 logit| / std of the fp32 logits", mode=mode)  # fmt: skip
        res.add(f"2b.{mode}.top1_agreement", "fraction", [float(agree.mean())],
                f"share of {len(chosen)} teacher-forced positions whose top token is fp32's", mode=mode)  # fmt: skip
        res.add(f"2b.{mode}.projection_share", "fraction", [stored / (2 * count)],
                "decoder projection bytes / the same in fp16", mode=mode)  # fmt: skip
        res.add(f"2b.{mode}.model_share", "fraction", [as_fp16 / (2 * total)],
                "whole model's weight bytes (the rest in fp16) / all weights in fp16", mode=mode)  # fmt: skip
        speed[mode] = _decode_tok_s(engine)
        res.add(f"2b.{mode}.decode_tok_s", "tok/s", speed[mode],
                f"CPU decode, {mode} projections (CPU kernels), {SPEED_TOKENS}-token answers", mode=mode)  # fmt: skip
        res.add(f"2b.{mode}.decode_vs_none", "x", [s / statistics.median(speed["none"]) for s in speed[mode]],
                "decode tok/s / the fp32 weights' median", mode=mode)  # fmt: skip
        res.setup[f"2b_{mode}_weight_path"] = engine.describe()["weight_path"]
        engine = None
        gc.collect()
    res.setup["2b_checkpoint"] = ctx.big_checkpoint_origin


def _load(ctx: BenchContext, res: SectionResult) -> None:
    """Loading the 2B shape as int4 from its bf16 checkpoint (quantized while it streams in) and from W4A16, AutoAWQ
    and GPTQ copies of it (kept as stored): seconds and peak RSS, each load a fresh process, alternating."""
    from support.quantized_copies import awq_copy, gptq_copy, int_copy

    copies = {
        "w4a16": lambda dst: int_copy(ctx.big_checkpoint(), dst, bits=4, group_size=LOAD_GROUP, vision=False),
        "awq": lambda dst: awq_copy(ctx.big_checkpoint(), dst, group_size=LOAD_GROUP),
        "gptq": lambda dst: gptq_copy(ctx.big_checkpoint(), dst, group_size=LOAD_GROUP),
    }
    sources = {"float": ctx.big_checkpoint()}
    for name, write in copies.items():
        sources[name] = ctx.scratch / f"big_{name}"
        if not (sources[name] / "model.safetensors").is_file():
            write(sources[name])
    runs: dict[str, list[dict]] = {name: [] for name in sources}
    for i in range(LOAD_REPEATS):
        for name, path in sources.items():
            ctx.log(f"quantization: 2B-shape int4 load from the {name} checkpoint ({i + 1}/{LOAD_REPEATS})")
            cmd = [sys.executable, "-m", "bench.load_probe", str(path), "bf16", "int4", str(LOAD_GROUP)]
            out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                raise RuntimeError(f"load_probe failed ({out.returncode}): {out.stderr[-1500:]}")
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for name, found in runs.items():
        how = "quantized while it loads" if name == "float" else "kept as stored"
        res.add(f"2b.load.{name}_int4.load_s", "s", [r["load_s"] for r in found],
                f"load_model, bf16, int4 group {LOAD_GROUP} from the {name} checkpoint ({how}), one thread",
                mode="int4")  # fmt: skip
        res.add(f"2b.load.{name}_int4.peak_rss_mb", "MB", [r["peak_rss_mb"] for r in found],
                "peak RSS of the loading process", mode="int4")  # fmt: skip
        res.add(f"2b.load.{name}_int4.weight_mb", "MB", [found[0]["weight_mb"]], "weights as loaded", mode="int4")
    float_s = statistics.median(r["load_s"] for r in runs["float"])
    for name in copies:
        res.add(f"2b.load.{name}_vs_float", "x", [r["load_s"] / float_s for r in runs[name]],
                f"int4 load time from the {name} copy / from the bf16 checkpoint (median)", mode="int4")  # fmt: skip


def _copy_accuracy(ctx: BenchContext, res: SectionResult, copy: Path, name: str, mode: str, float_score: float) -> None:
    """Held-out exact match of the default model's ``copy`` read with ``weight_quant=mode``, as figures
    ``default.<name>.*``: the score, the points lost against the float checkpoint and the weight bytes."""
    score, mb = _exact_match(copy, mode, ctx.config.quant_held_out)
    res.add(f"default.{name}.exact_match", "fraction", [score],
            f"held-out greedy exact match, {name} copy, weight_quant={mode}", mode=mode)  # fmt: skip
    res.add(f"default.{name}.exact_match_drop", "points", [100 * (float_score - score)],
            "exact-match points lost vs the float checkpoint (none)", mode=mode)  # fmt: skip
    res.add(f"default.{name}.weight_mb", "MB", [mb], "weights as stored (fp32 run)", mode=mode)


def _fp8(ctx: BenchContext, res: SectionResult, model_dir: Path, float_score: float) -> None:
    """Held-out exact match of the default model read from an FP8 copy of it, without and with ``int4``."""
    from support.quantized_copies import fp8_copy

    with tempfile.TemporaryDirectory(prefix="fp8_default_") as tmp:
        for name, layout in FP8_COPIES.items():
            fp8 = fp8_copy(model_dir, Path(tmp) / name, **layout)
            for mode in FP8_MODES:
                ctx.log(f"quantization: default model stored as {name}, weight_quant={mode}")
                _copy_accuracy(ctx, res, fp8, f"{name}_{mode}", mode, float_score)


def _int(ctx: BenchContext, res: SectionResult, model_dir: Path, float_score: float) -> None:
    """Held-out exact match of the default model read from integer copies of it, kept as stored: compressed-tensors'
    layouts, AutoAWQ's and GPTQ's."""
    from support.quantized_copies import awq_copy, gptq_copy, int_copy

    with tempfile.TemporaryDirectory(prefix="int_default_") as tmp:
        copies = {name: (int_copy(model_dir, Path(tmp) / name, vision=False, **layout), mode)
                  for name, (layout, mode) in INT_COPIES.items()}  # fmt: skip
        copies["awq"] = (awq_copy(model_dir, Path(tmp) / "awq", group_size=HUB_GROUP), "int4")
        copies["gptq"] = (gptq_copy(model_dir, Path(tmp) / "gptq", group_size=HUB_GROUP), "int4")
        for name, (copy, mode) in copies.items():
            ctx.log(f"quantization: default model stored as {name}, weight_quant={mode} (kept as stored)")
            _copy_accuracy(ctx, res, copy, name, mode, float_score)


def run(ctx: BenchContext) -> SectionResult:
    res = SectionResult("quantization")
    model_dir, what = ctx.default_model()
    scores = {}
    held_out = ctx.config.quant_held_out
    for mode in MODES:
        ctx.log(f"quantization: default model, weight_quant={mode}, {held_out} held-out samples")
        scores[mode], mb = _exact_match(model_dir, mode, held_out)
        res.add(f"default.{mode}.exact_match", "fraction", [scores[mode]], "held-out greedy exact match", mode=mode)
        res.add(f"default.{mode}.weight_mb", "MB", [mb], "weights as stored (fp32 run)", mode=mode)
    for mode in MODES[1:]:
        res.add(f"default.{mode}.exact_match_drop", "points", [100 * (scores["none"] - scores[mode])],
                "exact-match points lost vs none", mode=mode)  # fmt: skip
    _fp8(ctx, res, model_dir, scores["none"])
    _int(ctx, res, model_dir, scores["none"])
    missing = ctx.big_checkpoint_missing()
    if missing:
        res.skip_part("2b", missing)
    else:
        ctx.log("quantization: 2B-shape checkpoint, teacher-forced logits vs fp32")
        _big(ctx, res)
        _load(ctx, res)
    res.setup.update(
        model=what,
        held_out=held_out,
        big_tokens=BIG_TOKENS,
        summary=(
            f"{what}: held-out exact match per weight_quant (int4 group 128), also read from FP8 copies "
            f"({', '.join(FP8_COPIES)}) and integer ones kept as stored ({', '.join(INT_COPIES)}); "
            f"2B-shape random checkpoint: "
            f"{BIG_TOKENS} greedy fp32 tokens fed through int8/int4 models, logit error and top-1 agreement; "
            f"CPU decode tok/s per mode ({SPEED_REPEATS} answers of {SPEED_TOKENS} tokens); weight bytes vs fp16."
        ),
    )
    return res
