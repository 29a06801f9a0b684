"""Structured output: what a format costs a decode, and what compiling one costs.

1. ``decode``: decode tokens/s of an answer held to a JSON schema (an array of digits: a fixed length
   whatever the weights) against free text of the same length (``ignore_eos``), alternated, one ratio per
   pair (``json_vs_free``). The format's mask is computed on the host for every token; on a GPU while the
   device computes the step (the engine reads a token after launching the next step), on the CPU after it.
   On the 2B-shape random checkpoint (bf16, full/medium mode: its logits are Qwen3-VL's 151,936 wide, its
   tokenizer the test one of 1,024 entries; 20 digits, a minute a pair on 2 cores), and on the default model
   (60 digits), whose 1.4 ms decode step is mostly dispatch, so there the mask's tens of microseconds show.
2. ``compile``: the first compile of the grounding format (two labels, one image) and of a 20-property
   schema for the default model's tokenizer (its token table built before, as the engine keeps it), and a
   repeat of the same format (served by content from the engine's cache).
3. ``detect``: the default model on its held-out grounding scenes (100 in full/medium mode), each asked as
   the node asks (the grounding prompt and format, greedy): objects found (right label, IoU >= 0.5 in the
   picture's pixels; a point inside the true box), scenes without an invented object, answers that did not
   parse; and half as many held-out "List the shapes as JSON." questions held to their schema (parsed value
   equal to the truth).
"""

from __future__ import annotations

import time

from bench.context import BenchContext
from bench.section import SectionResult
from bench.stats import alternate, paired_ratio
from bench.timing import run_engine
from bench.vs_transformers import make_engine


def digits_schema(n: int) -> dict:
    """An array of exactly ``n`` digits: an answer of a fixed length whatever the weights."""
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": n, "maxItems": n}


PROPERTIES_20 = {
    "type": "object",
    "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"][i % 3]} for i in range(20)},
    "required": [f"field_{i}" for i in range(20)],
    "additionalProperties": False,
}


def _decode(res: SectionResult, prefix: str, engine, digits: int, repeats: int, warmup: int) -> None:
    """Decode tok/s with the digits schema vs free text of as many tokens, alternated."""
    from orin_vlm_node.engine import Request, SamplingParams, Turn, output_format

    fmt = output_format("json_schema", digits_schema(digits))
    constrained = run_engine(engine, Request(Turn("List the digits."), SamplingParams(temperature=0.0), output=fmt))
    tokens = len(constrained.token_ids)
    free = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
    runs = alternate(
        {
            "free": lambda: run_engine(engine, Request(Turn("List the digits."), free)),
            "json": lambda: run_engine(
                engine, Request(Turn("List the digits."), SamplingParams(temperature=0.0), output=fmt)
            ),
        },
        repeats=repeats,
        warmup=warmup,
    )
    f, j = [r.decode_tok_s for r in runs["free"]], [r.decode_tok_s for r in runs["json"]]
    res.add(f"{prefix}decode.free.tok_s", "tok/s", f, "decode tokens/s, free text", format="none")
    res.add(f"{prefix}decode.json.tok_s", "tok/s", j, "decode tokens/s, held to a JSON schema", format="json")
    res.add(f"{prefix}decode.json_vs_free", "ratio", paired_ratio(j, f), "tok/s with the format / without, per pair")
    res.setup[f"{prefix}decode_tokens"] = tokens


def _compile(res: SectionResult, engine, repeats: int) -> None:
    """Compiles of formats not seen before (the token table built first, as the engine keeps it), and the
    same format again (served by content). Each repeat titles its schema apart: a new format to the cache,
    the same grammar to compile."""
    from orin_vlm_node.engine import OutputFormat, output_format
    from orin_vlm_node.engine.grounding import grounding_request
    from orin_vlm_node.engine.output_format import Grammars

    parts = engine.parts
    grammars = Grammars(parts.tokenizer, parts.model_config.text.vocab_size)
    t0 = time.perf_counter()
    grammars.compile(output_format("choice", ["yes", "no"]))
    res.setup["token_table_s"] = round(time.perf_counter() - t0, 4)
    formats = {"grounding": grounding_request(("red cup", "person"), 1)[1].spec, "schema_20": PROPERTIES_20}
    for name, schema in formats.items():
        first, again = [], []
        for i in range(repeats):
            fmt = OutputFormat("json_schema", {**schema, "title": f"{name} {i}"})
            t0 = time.perf_counter()
            grammars.compile(fmt)
            first.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            grammars.compile(fmt)
            again.append((time.perf_counter() - t0) * 1e3)
        res.add(f"compile.{name}.first_ms", "ms", first, f"compile of the {name} format, first time")
        res.add(f"compile.{name}.cached_ms", "ms", again, f"the {name} format again (cached by content)")


def _detect(res: SectionResult, engine, scenes: int) -> None:
    """Accuracy of the default model's answers in a format (one pass: greedy answers do not vary)."""
    from support import scene_formats

    tasks, lists = scene_formats.held_out_grounding(scenes), scene_formats.held_out_shape_lists(scenes // 2)
    acc = scene_formats.engine_accuracy(engine, tasks, lists)
    res.add("detect.objects_found", "fraction", [acc.objects_found], "objects found (IoU >= 0.5 in pixels)")
    res.add("detect.scenes_clean", "fraction", [acc.scenes_clean], "scenes without an invented object")
    res.add("detect.unparsed", "count", [acc.unparsed], "grounding answers that did not parse")
    res.add("shape_list.exact", "fraction", [acc.shape_lists], "shape lists equal to the truth")
    res.setup["detect_scenes"], res.setup["shape_lists"] = len(tasks), len(lists)


def run(ctx: BenchContext) -> SectionResult:
    cfg = ctx.config
    res = SectionResult("structured")
    model_dir, what = ctx.default_model()
    engine = make_engine(model_dir, "fp32")
    res.setup["default_model"] = what
    _decode(res, "", engine, 60, cfg.repeats, cfg.warmup)
    _compile(res, engine, cfg.repeats)
    _detect(res, engine, cfg.detect_scenes)
    missing = ctx.big_checkpoint_missing()
    if missing:
        res.skip_part("2b_bf16.decode", missing)
        return res
    big = make_engine(ctx.big_checkpoint(), "bf16")
    _decode(res, "2b_bf16.", big, 20, max(cfg.big_repeats, 5), 1)
    res.setup["2b_checkpoint"] = ctx.big_checkpoint_origin
    return res
