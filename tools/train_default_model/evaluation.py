"""Scoring with transformers' generate (the reference; the acceptance tests score our engine)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from support import scene_formats as formats
from support import synthetic_scenes as scenes

from .batches import Encoder, Pixels
from .vocabulary import SPECIAL_TOKENS


@torch.no_grad()
def hf_answer(
    model, enc: Encoder, pixels: Pixels, question: str, image: np.ndarray | None, max_new_tokens: int = 32
) -> str:
    """Greedy answer from transformers' generate, decoded without special tokens."""
    kwargs: dict[str, torch.Tensor] = {}
    n = None
    if image is not None:
        pv, grid, ntok = pixels([image])
        n = ntok[0]
        kwargs = {"pixel_values": pv.to(model.dtype), "image_grid_thw": grid}
    ids = torch.tensor([enc.prompt(question, n)])
    eos = [enc.ids["<|im_end|>"], enc.ids["<|endoftext|>"]]
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == enc.ids["<|image_pad|>"]).long(),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=enc.ids["<|endoftext|>"],
        **kwargs,
    )
    new = [t for t in out[0, ids.shape[1] :].tolist() if t not in eos]
    return enc.tok.decode(new)


def evaluate(model, enc: Encoder, pixels: Pixels, samples: list[scenes.Sample]) -> dict[str, float]:
    """Exact-match accuracy overall and per (qtype, lang)."""
    model.eval()
    hits: dict[str, list[int]] = defaultdict(list)
    for s in samples:
        ok = int(hf_answer(model, enc, pixels, s.question, s.image).strip() == s.answer)
        hits["overall"].append(ok)
        hits[f"{s.qtype}/{s.lang}"].append(ok)
        hits[s.qtype].append(ok)
    return {k: float(np.mean(v)) for k, v in sorted(hits.items())}


def evaluate_formats(
    model, enc: Encoder, pixels: Pixels, tasks: list[formats.GroundingTask], lists: list[scenes.Sample]
) -> dict[str, float]:
    """Grounding (objects found, scenes without an invented object, answers that parse) and shape lists
    (exact match of the parsed JSON), answered without a grammar: what the model writes on its own."""
    model.eval()
    found = expected = clean = parsed = 0
    for task in tasks:
        expected += len(task.truth)
        text = hf_answer(model, enc, pixels, task.sample.question, task.sample.image, 320)
        h, w = task.sample.image.shape[:2]
        try:
            score = formats.score_grounding(task, formats.answer_boxes(text, h, w))
        except ValueError:
            continue
        parsed += 1
        found += score.found
        clean += score.invented == 0
    listed = 0
    for s in lists:
        try:
            listed += json.loads(hf_answer(model, enc, pixels, s.question, s.image, 128)) == json.loads(s.answer)
        except ValueError:
            pass
    n = max(1, len(tasks))
    return {
        "objects_found": found / max(1, expected),
        "scenes_clean": clean / n,
        "grounding_parsed": parsed / n,
        "shape_lists": listed / max(1, len(lists)),
    }


def eval_checkpoint(out: Path, n: int, allow_fallback: bool) -> dict[str, float]:
    """Load the saved (bf16) checkpoint in float32, as the engine does on the CPU, and score it."""
    from tokenizers import Tokenizer
    from transformers import Qwen3VLForConditionalGeneration

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
    enc, pixels = Encoder(tok, ids), Pixels(out, allow_fallback)
    acc = evaluate(model, enc, pixels, scenes.held_out_samples(n))
    acc.update(evaluate_formats(model, enc, pixels, formats.held_out_grounding(), formats.held_out_shape_lists()))
    print(f"checkpoint eval (n={n}) {json.dumps(acc)}", flush=True)
    return acc
