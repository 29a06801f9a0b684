"""Engine greedy decoding against transformers ``generate`` on a tiny random Qwen3-VL (fp32, eager).

Both sides get the same prompt ids (rendered by our chat template) and the same pixel_values (from
our image processor), so only generation is compared. EOS is set to a token transformers never
produced, so all 64 tokens are compared. Every KV layout (contiguous; paged with page sizes 1, 4, 16,
i.e. dozens of page crossings after the image tokens; prompts prefilled in pieces of 7 and 5 tokens) runs
on one engine reconfigured between layouts.
On the CPU the engine decodes with the dynamic step; ``test_engine_decode_step`` holds the static step
(what CUDA graphs capture) to the dynamic one logit for logit over the same layouts.
"""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest
import torch

from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn
from support.checkpoints import cached_tiny_checkpoint

torch.set_num_threads(1)  # tiny matrices: thread hand-off costs more than it saves on a shared CI box

STEPS = 64
CHECKPOINTS = {
    "gqa2_hd32_untied": dict(
        layers=2, num_heads=4, num_kv_heads=2, head_dim=32, hidden=64, deepstack=(0, 1), tie=False, seed=5
    ),
    "mqa_hd64_tied": dict(
        layers=2, num_heads=4, num_kv_heads=1, head_dim=64, hidden=64, deepstack=(1,), tie=True, seed=6
    ),
}
LAYOUTS = [
    dict(use_paged_attention=False),
    dict(use_paged_attention=True, page_size=1),
    dict(use_paged_attention=True, page_size=4),
    dict(use_paged_attention=True, page_size=16),
    # Prompts prefilled in pieces of 7 and 5 tokens: pieces end inside the image pads and inside pages.
    dict(use_paged_attention=True, page_size=4, prefill_chunk_tokens=7),
    dict(use_paged_attention=False, prefill_chunk_tokens=5),
]


def _image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


CASES = {
    "text_only": Turn("Describe the robot arm and the red cube."),
    "one_image": Turn("Describe this image in detail.", (_image(96, 160, 1),)),
    "two_images": Turn("What objects are in front of the camera?", (_image(128, 96, 2), _image(70, 200, 3))),
    "three_images": Turn(
        "Head, wrist and rear camera: what changed?", (_image(64, 64, 4), _image(96, 160, 5), _image(160, 48, 6))
    ),
}


@functools.cache
def _setup(tmp_root: str, checkpoint: str):
    """Checkpoint copy with an unreachable EOS, and the transformers reference for every case."""
    from transformers import Qwen3VLForConditionalGeneration

    src = cached_tiny_checkpoint(**CHECKPOINTS[checkpoint])
    hf = Qwen3VLForConditionalGeneration.from_pretrained(src, attn_implementation="eager", dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    probe = Engine(EngineConfig(model_path=str(src), max_context_tokens=512))  # renders prompts + pixels
    refs = {}
    for name, turn in CASES.items():
        batch = probe.parts.image_processor.preprocess(list(turn.images)) if turn.images else None
        ids, _ = probe.parts.turns.renderer.first_turn(None, turn, batch.num_tokens if batch else [])
        kwargs = dict(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        if batch is not None:
            image_token = probe.parts.model_config.image_token_id
            mm = torch.tensor([[1 if t == image_token else 0 for t in ids]], dtype=torch.int32)
            kwargs.update(pixel_values=batch.pixel_values, image_grid_thw=batch.grid_thw, mm_token_type_ids=mm)
        with torch.no_grad():
            out = hf.generate(**kwargs, max_new_tokens=STEPS, do_sample=False, top_k=None, top_p=None, temperature=None)
        refs[name] = (ids, out[0, len(ids) :].tolist())
    used = {t for _, toks in refs.values() for t in toks}
    eos = next(t for t in range(8, 1024) if t not in used)
    dst = f"{tmp_root}/{checkpoint}"
    shutil.copytree(src, dst)
    gen_cfg = json.loads(open(f"{dst}/generation_config.json").read())
    gen_cfg["eos_token_id"] = [eos]
    with open(f"{dst}/generation_config.json", "w") as f:
        json.dump(gen_cfg, f)
    return dst, refs


@pytest.fixture(scope="module")
def parity_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("engine_parity"))


def _greedy(engine: Engine, turn: Turn):
    events = list(engine.generate(Request(turn, SamplingParams(temperature=0.0, max_new_tokens=STEPS))))
    final = events[-1]
    assert final.finish_reason == "length", final.error
    return final


def test_greedy_matches_transformers_generate_all_layouts(parity_root):
    path, refs = _setup(parity_root, "gqa2_hd32_untied")
    engine = Engine(EngineConfig(model_path=path, max_context_tokens=256))
    assert engine.describe()["decode_path"].startswith("torch reference")
    for layout in LAYOUTS:
        engine.reconfigure(**layout)
        for name, turn in CASES.items():
            ids, ref = refs[name]
            assert len(set(ref)) >= 4, "a near-constant reference would make the comparison weak"
            final = _greedy(engine, turn)
            assert list(final.token_ids) == ref, f"{name} {layout}"
            assert final.metrics["prompt_tokens"] == len(ids)
            assert engine.parts.cache.stats()["blocks_used"] == 0  # the request's sequence was released


def test_greedy_matches_transformers_generate_second_checkpoint(parity_root):
    """MQA, head_dim 64, tied lm_head, DeepStack from a later vision block."""
    path, refs = _setup(parity_root, "mqa_hd64_tied")
    engine = Engine(EngineConfig(model_path=path, max_context_tokens=256))
    for layout in (dict(use_paged_attention=True, page_size=4), dict(use_paged_attention=False, use_cuda_graph=False)):
        engine.reconfigure(**layout)
        for name in ("one_image", "two_images", "three_images"):
            assert list(_greedy(engine, CASES[name]).token_ids) == refs[name][1], f"{name} {layout}"
