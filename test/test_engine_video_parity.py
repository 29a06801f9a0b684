"""Video prompts against transformers' Qwen3-VL on tiny random checkpoints (fp32, eager).

The reference is built from transformers' own video pieces: ``smart_resize`` and ``patchify`` of its
``Qwen3VLVideoProcessor``, the timestamps of its ``Qwen3VLProcessor``, ``get_rope_index`` and the model. Two
steps of that processor are torchvision calls, which cannot be installed against this torch build; they are
written here as torchvision runs them on the CPU (``interpolate`` on uint8, bicubic, antialiased; then
``(x - 255 mean) / (255 std)`` in float32). The prompt follows Qwen's layout (the template's
``<|vision_start|><|video_pad|><|vision_end|>`` replaced by the timestamped frame groups), tokenized as
one text by the checkpoint's tokenizer, and must equal the engine's ids; then greedy tokens and the
probability of each must match transformers' ``generate`` on those ids.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from test_engine_parity import CHECKPOINTS  # a GQA and an MQA model, DeepStack from different blocks

from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn, Video
from orin_vlm_node.processing import ImageProcessor, VideoProcessor
from support.checkpoints import cached_tiny_checkpoint

torch.set_num_threads(1)

STEPS = 24


def _frames(count: int, h: int, w: int, seed: int) -> list[np.ndarray]:
    """Frames of a moving bright square on noise: consecutive frames differ, as a camera's do."""
    rng = np.random.default_rng(seed)
    frames = []
    for i in range(count):
        frame = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        x = (i * 7) % max(1, w - 16)
        frame[h // 3 : h // 3 + 16, x : x + 16] = (250, 40, 40)
        frames.append(frame)
    return frames


def _video(count: int, fps: float, h: int, w: int, seed: int) -> Video:
    return Video(tuple(_frames(count, h, w, seed)), tuple(i / fps for i in range(count)))


CASES = {
    "2_frames_2fps": Turn("What moved?", videos=(_video(2, 2.0, 64, 96, 1),)),
    "3_frames_4fps": Turn("Which way did the square go?", videos=(_video(3, 4.0, 96, 64, 2),)),
    "8_frames_1fps": Turn("Where did it go?", videos=(_video(8, 1.0, 80, 80, 3),)),
    "image_and_8_frames_3fps": Turn(
        "Compare the picture with the clip.",
        images=(_frames(1, 96, 128, 9)[0],),
        videos=(_video(8, 3.0, 70, 100, 4),),
    ),
}


def _reference_pixels(video: Video, cfg) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """pixel_values_videos, video_grid_thw and the group timestamps, as transformers computes them."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize

    frames = torch.from_numpy(np.stack(video.frames)).permute(0, 3, 1, 2)  # (T, 3, H, W) uint8
    h, w = smart_resize(frames.shape[0], frames.shape[2], frames.shape[3], cfg.temporal_patch_size, cfg.factor,
                        cfg.min_pixels, cfg.max_pixels)  # fmt: skip
    if (h, w) != tuple(frames.shape[-2:]):
        frames = torch.nn.functional.interpolate(frames, size=(h, w), mode="bicubic", align_corners=False,
                                                 antialias=True)  # fmt: skip
    mean = (torch.tensor(cfg.image_mean) * (1.0 / cfg.rescale_factor)).view(1, 3, 1, 1)
    std = (torch.tensor(cfg.image_std) * (1.0 / cfg.rescale_factor)).view(1, 3, 1, 1)
    normed = frames.to(torch.float32).sub_(mean).div_(std)
    patches, gt, gh, gw = Qwen3VLVideoProcessor.patchify(
        None, normed[None], cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    )
    fps = 1.0 / (video.times[1] - video.times[0])
    stamps = Qwen3VLProcessor._calculate_timestamps(None, list(range(len(video.frames))), fps, cfg.temporal_patch_size)
    return patches[0], torch.tensor([[gt, gh, gw]]), stamps


def _qwen_layout_ids(path: str, text: str, image_tokens: list[int], stamps: list[float], group_tokens: int):
    """The prompt as Qwen's processor builds it: image pads repeated, the video placeholder replaced, then the
    whole text tokenized."""
    from tokenizers import Tokenizer

    for n in image_tokens:
        text = text.replace("<|image_pad|>", "\0" * n, 1)
    text = text.replace("\0", "<|image_pad|>")
    groups = "".join(f"<{t:.1f} seconds><|vision_start|>" + "<|video_pad|>" * group_tokens + "<|vision_end|>"
                     for t in stamps)  # fmt: skip
    placeholder = "<|vision_start|><|video_pad|><|vision_end|>"
    assert text.count(placeholder) == 1
    return Tokenizer.from_file(f"{path}/tokenizer.json").encode(text.replace(placeholder, groups)).ids


@functools.cache
def _reference(checkpoint: str, name: str):
    """(prompt ids, greedy tokens, their probabilities) of transformers on the Qwen-layout prompt."""
    from transformers import Qwen3VLForConditionalGeneration

    path = str(cached_tiny_checkpoint(**CHECKPOINTS[checkpoint]))
    turn = CASES[name]
    cfg = VideoProcessor.from_pretrained(path).config
    video_pixels, video_grid, stamps = _reference_pixels(turn.videos[0], cfg)
    probe = Engine(EngineConfig(model_path=path, max_context_tokens=1024))
    renderer = probe.parts.turns.renderer
    from orin_vlm_node.engine.conversation import user_message
    from orin_vlm_node.processing import render_prompt

    text = render_prompt(renderer.template, [user_message(turn)], probe.parts.tokenizer.special_texts).text
    images = ImageProcessor.from_pretrained(path).preprocess(list(turn.images)) if turn.images else None
    image_tokens = images.num_tokens if images is not None else []
    ids = _qwen_layout_ids(path, text, image_tokens, stamps, int(video_grid[0, 1:].prod()) // cfg.merge_size**2)
    image_token, video_token = probe.parts.model_config.image_token_id, probe.parts.model_config.video_token_id
    mm = torch.tensor([[1 if t == image_token else 2 if t == video_token else 0 for t in ids]], dtype=torch.int32)
    kwargs = dict(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                  mm_token_type_ids=mm, pixel_values_videos=video_pixels, video_grid_thw=video_grid)  # fmt: skip
    if images is not None:
        kwargs.update(pixel_values=images.pixel_values, image_grid_thw=images.grid_thw)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(**kwargs, max_new_tokens=STEPS, do_sample=False, top_k=None, top_p=None, temperature=None,
                          output_scores=True, return_dict_in_generate=True)  # fmt: skip
    tokens = out.sequences[0, len(ids) :].tolist()
    probs = [float(torch.softmax(s[0].double(), -1)[t]) for s, t in zip(out.scores, tokens, strict=True)]
    return path, ids, tokens, probs


@pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_video_prompt_matches_transformers(checkpoint: str, name: str):
    path, ids, ref_tokens, ref_probs = _reference(checkpoint, name)
    assert len(set(ref_tokens)) >= 4, "a near-constant reference would make the comparison weak"
    engine = Engine(EngineConfig(model_path=path, max_context_tokens=1024))
    turn = engine.parts.turns.prepare(CASES[name], None, None, 1024)
    assert turn.new_ids == ids
    request = Request(CASES[name], SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True),
                      token_probs=True)  # fmt: skip
    *_, final = engine.generate(request)
    assert final.finish_reason == "length", final.error
    assert list(final.token_ids) == ref_tokens
    np.testing.assert_allclose(final.token_probs, ref_probs, rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize(
    "layout",
    [
        dict(use_paged_attention=True, page_size=4, prefill_chunk_tokens=7),  # pieces end inside frame groups
        dict(use_paged_attention=False, prefill_chunk_tokens=5),
    ],
)
def test_video_prompt_matches_transformers_in_pieces_and_pages(layout):
    path, _, ref_tokens, _ = _reference("gqa2_hd32_untied", "image_and_8_frames_3fps")
    engine = Engine(EngineConfig(model_path=path, max_context_tokens=1024, **layout))
    request = Request(CASES["image_and_8_frames_3fps"], SamplingParams(temperature=0.0, max_new_tokens=STEPS,
                                                                        ignore_eos=True))  # fmt: skip
    *_, final = engine.generate(request)
    assert list(final.token_ids) == ref_tokens
    *_, again = engine.generate(request)  # with paged KV the prefix cache serves the frame groups' blocks
    assert list(again.token_ids) == ref_tokens
    assert (again.metrics["prefix_hit_tokens"] > 0) == layout["use_paged_attention"]  # paged KV: a prefix cache


def test_video_max_tokens_bounds_a_long_history():
    path = str(cached_tiny_checkpoint(**CHECKPOINTS["gqa2_hd32_untied"]))
    history = _video(40, 1.0, 200, 300, 7)
    engine = Engine(EngineConfig(model_path=path, max_context_tokens=1024, video_max_tokens=16))
    prepared = engine.parts.turns.prepare(Turn("What happened?", videos=(history,)), None, None, 1024)
    (layout,) = prepared.videos
    assert layout.tokens == sum(prepared.images.num_tokens) <= 16 and layout.frames_used < 40
    engine.reconfigure(video_max_tokens=4096)
    (whole,) = engine.parts.turns.prepare(Turn("What happened?", videos=(history,)), None, None, 4096).videos
    assert whole.frames_used == 40 and whole.tokens > 16


def test_a_session_continues_after_a_video_turn_as_transformers_reads_the_whole_conversation():
    """Turn 1 asks about one video, turn 2 about another: turn 2's positions continue after turn 1's frame
    groups (dual position tracking), and its tokens are transformers' on the whole conversation's ids."""
    from transformers import Qwen3VLForConditionalGeneration

    path = str(cached_tiny_checkpoint(**CHECKPOINTS["gqa2_hd32_untied"]))
    engine = Engine(EngineConfig(model_path=path, max_context_tokens=1024, page_size=4, prefill_chunk_tokens=9))
    first, second = _video(8, 2.0, 64, 96, 11), _video(3, 1.0, 96, 64, 12)
    t1, t2 = Turn("What moved?", videos=(first,)), Turn("And in this clip?", videos=(second,))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True)
    r1 = list(engine.generate(Request(t1, greedy, session_id="s")))[-1]
    history = engine.session_token_ids("s")
    r2 = list(engine.generate(Request(t2, greedy, session_id="s")))[-1]
    videos = engine.parts.turns.video_processor.preprocess([first, second])
    from orin_vlm_node.engine.conversation import user_message

    delta, _ = engine.parts.turns.renderer.next_turn([user_message(t1)], r1.text, t2, [], videos=videos.layouts[1:])
    full = history + delta
    assert r2.metrics["prompt_tokens"] == len(full)
    patch = engine.parts.turns.video_processor.config.patch_size
    grid = torch.tensor([[len(v.timestamps), v.size[0] // patch, v.size[1] // patch] for v in videos.layouts])
    video_token = engine.parts.model_config.video_token_id
    hf = Qwen3VLForConditionalGeneration.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([full]), attention_mask=torch.ones(1, len(full), dtype=torch.long),
                          mm_token_type_ids=torch.tensor([[2 if t == video_token else 0 for t in full]]),
                          pixel_values_videos=videos.groups.pixel_values, video_grid_thw=grid, max_new_tokens=STEPS,
                          do_sample=False, top_k=None, top_p=None, temperature=None)  # fmt: skip
    assert list(r2.token_ids) == out[0, len(full) :].tolist()
