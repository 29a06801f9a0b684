"""The embedded default model's files and its synthetic data set.

Why: the checkpoint must be a genuine Qwen3-VL (the same architecture the engine serves for real models:
DeepStack, interleaved M-RoPE, tied embeddings), small enough to ship as package data, with the Qwen special
tokens, a ChatML template and greedy generation defaults; and the data generator must be deterministic,
bilingual and keep held-out samples apart from training samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from support import synthetic_scenes as scenes

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "orin_vlm_node" / "default_model"

QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
needs_checkpoint = pytest.mark.skipif(
    not (MODEL_DIR / "model.safetensors").is_file(), reason="default model checkpoint not built"
)


# ------------------------------------------------------------------------------------------------------------
# Data set


def test_samples_are_deterministic_by_seed():
    a = scenes.make_samples(3, 20)
    b = scenes.make_samples(3, 20)
    c = scenes.make_samples(4, 20)
    for x, y in zip(a, b, strict=True):
        assert (x.question, x.answer, x.qtype, x.lang) == (y.question, y.answer, y.qtype, y.lang)
        assert (x.image is None and y.image is None) or np.array_equal(x.image, y.image)
    assert [s.answer for s in a] != [s.answer for s in c] or any(
        not np.array_equal(x.image, y.image)
        for x, y in zip(a, c, strict=True)
        if x.image is not None and y.image is not None
    )


def test_samples_cover_every_question_type_in_both_languages():
    samples = scenes.make_samples(0, 400)
    kinds = {(s.qtype, s.lang) for s in samples}
    assert kinds == {(q, lang) for q in scenes.QTYPE_WEIGHTS for lang in ("en", "zh")}
    for s in samples:
        if s.qtype == "chat":
            assert s.image is None
            continue
        assert s.image.dtype == np.uint8 and s.image.ndim == 3 and s.image.shape[2] == 3
        assert 64 <= min(s.image.shape[:2]) and max(s.image.shape[:2]) <= 160
        if s.lang == "zh":
            assert all(ord(c) > 0x2E7F for c in s.answer), s.answer  # Chinese answers: CJK only
    sizes = {s.image.shape[:2] for s in samples if s.image is not None}
    assert len(sizes) > 100, "image sizes and aspect ratios should vary"


def test_answers_follow_the_scene():
    """Re-derive answers from the drawn pixels for single-shape colour questions: the shape's pixels have the
    named colour (nearest base colour), so the label is what the image shows."""
    checked = 0
    rng = np.random.default_rng(5)
    for _ in range(300):
        s = scenes.sample(rng)
        if s.qtype != "describe" or s.lang != "en" or " and " in s.answer:
            continue
        color = s.answer.split()[1]
        img = s.image.reshape(-1, 3).astype(np.float64)
        base = np.array(list(scenes.COLORS.values()), dtype=np.float64)
        dist = ((img[:, None, :] - base[None]) ** 2).sum(-1)  # (pixels, colours)
        near = dist.min(1) < 40**2  # pixels that are clearly one of the shape colours
        assert near.sum() > 50, "the shape should cover a visible area"
        votes = np.bincount(dist[near].argmin(1), minlength=len(base))
        assert list(scenes.COLORS)[int(votes.argmax())] == color
        checked += 1
    assert checked >= 10


def test_label_map_marks_the_drawn_shapes():
    """The label map the dense vision objective learns from: pixels labelled ``i + 1`` show shape ``i``'s colour,
    background pixels show no shape colour (up to anti-aliased edges), and the image is the one ``sample`` draws."""
    rng = np.random.default_rng(9)
    base = {name: np.array(rgb, dtype=np.float64) for name, rgb in scenes.COLORS.items()}
    checked = 0
    for _ in range(60):
        state = rng.bit_generator.state
        s, scene = scenes.sample_with_scene(rng)
        rng_again = np.random.default_rng()
        rng_again.bit_generator.state = state
        again = scenes.sample(rng_again)
        assert again.answer == s.answer and (s.image is None or np.array_equal(again.image, s.image))
        if s.image is None:
            assert scene.labels is None and scene.shapes == []
            continue
        assert scene.labels.shape == s.image.shape[:2] and scene.labels.max() == len(scene.shapes)
        img = s.image.astype(np.float64)
        for i, shape in enumerate(scene.shapes):
            mask = scene.labels == i + 1
            near = np.linalg.norm(img[mask] - base[shape.color], axis=1) < 60  # colour jitter + AA edges
            assert near.mean() > 0.85, (shape, near.mean())
        if scene.sides is not None:  # pair layouts: the sides named are where the shapes are
            ys, xs = zip(*(np.nonzero(scene.labels == i + 1) for i in range(2)), strict=True)
            axis = xs if scene.sides == ("left", "right") else ys
            assert axis[0].mean() < axis[1].mean() and s.qtype in ("position", "describe")
        background = img[scene.labels == 0]
        colourful = np.stack([np.linalg.norm(background - c, axis=1) < 40 for c in base.values()]).any(0)
        assert colourful.mean() < 0.02
        checked += 1
    assert checked >= 40


def test_token_labels_name_the_shape_under_each_token():
    from support.scene_formats import pixel_box
    from tools.train_default_model.dense_targets import COLOR_BACKGROUND, IGNORE, SHAPE_BACKGROUND, SIDES, token_labels

    star = scenes.Shape("star", "purple", 40.0, 60.0, 30.0)
    square = scenes.Shape("square", "green", 100.0, 60.0, 14.0)
    rng = np.random.default_rng(0)
    _, labels = scenes.render_with_labels(rng, 128, 128, [star, square])
    scene = scenes.Scene([star, square], labels, ("left", "right"))
    kinds, colors, sides, boxes = token_labels(scene, [1, 8, 8])  # 4 x 4 tokens of 32 px
    kinds, colors, sides = kinds.view(4, 4), colors.view(4, 4), sides.view(4, 4)
    star_box = np.array(pixel_box(labels, 0)) / 128 * 2 - 1  # the star's pixel box, in [-1, 1]
    assert np.allclose(boxes.view(4, 4, 4)[1, 1].numpy(), star_box) and boxes.view(4, 4, 4)[3, 3].isnan().all()
    assert sides[1, 1] == SIDES.index("left") and sides[1, 3] == SIDES.index("right") and sides[3, 3] == IGNORE
    unsided = token_labels(scenes.Scene([star, square], labels), [1, 8, 8])[2]  # not a pair layout
    assert (unsided == IGNORE).all()
    assert kinds[1, 1] == scenes.SHAPES.index("star") and colors[1, 1] == list(scenes.COLORS).index("purple")
    assert kinds[1, 3] == scenes.SHAPES.index("square") and colors[1, 3] == list(scenes.COLORS).index("green")
    assert kinds[3, 3] == SHAPE_BACKGROUND and colors[3, 3] == COLOR_BACKGROUND  # empty corner
    assert kinds[0, 0] == SHAPE_BACKGROUND  # the star's tip grazes it: under a quarter covered
    assert ((kinds == SHAPE_BACKGROUND) == (colors == COLOR_BACKGROUND)).all()


def test_each_shape_pools_the_tokens_it_covers_in_its_own_picture():
    """The shape-level kind target: row i of ``shape_pool`` spreads over the tokens shape i covers (counted from
    its label-map pixels per 32-pixel token), only in its own picture of the batch, and sums to 1."""
    import torch

    from tools.train_default_model.dense_targets import dense_targets

    star = scenes.Shape("star", "purple", 40.0, 60.0, 30.0)
    square = scenes.Shape("square", "green", 100.0, 60.0, 14.0)
    circle = scenes.Shape("circle", "red", 30.0, 30.0, 12.0)
    rng = np.random.default_rng(0)
    _, two = scenes.render_with_labels(rng, 128, 128, [star, square])
    _, one = scenes.render_with_labels(rng, 64, 64, [circle])
    grid = torch.tensor([[1, 8, 8], [1, 4, 4]])  # 16 tokens, then 4
    t = dense_targets([scenes.Scene([star, square], two), scenes.Scene([circle], one)], grid)
    assert t.shape_pool.shape == (3, 20) and t.shape_kinds.tolist() == [scenes.SHAPES.index(k) for k in
                                                                        ("star", "square", "circle")]  # fmt: skip
    assert torch.allclose(t.shape_pool.sum(1), torch.ones(3))
    for row, (labels, index, first, side) in enumerate(((two, 1, 0, 4), (two, 2, 0, 4), (one, 1, 16, 2))):
        pixels = (labels == index).reshape(side, 32, side, 32).sum((1, 3)).reshape(-1).astype(np.float64)
        expected = np.zeros(20)
        expected[first : first + side * side] = pixels / pixels.sum()
        assert np.allclose(t.shape_pool[row].numpy(), expected, atol=1e-6), row


def test_subjects_say_which_shape_each_part_of_the_answer_is_about():
    """Colour and position answers are about the shape the question names, a description names its shapes left
    to right, a shape answer is about the only shape; counting and chat have no subject."""
    rng = np.random.default_rng(21)
    seen = set()
    for _ in range(300):
        s, scene = scenes.sample_with_scene(rng)
        if s.qtype in ("count", "chat"):
            assert scene.subjects == ()
            continue
        starts = [start for start, _ in scene.subjects]
        assert starts[0] == 0 and starts == sorted(set(starts)) and all(start < len(s.answer) for start in starts)
        parts = [s.answer[a:b] for a, b in zip(starts, starts[1:] + [len(s.answer)], strict=True)]
        for part, (_, i) in zip(parts, scene.subjects, strict=True):
            shape = scene.shapes[i]
            name = scenes.shape_name(shape.kind, s.lang)
            if s.qtype == "position":
                assert (
                    name in s.question
                    and part == (scenes.WHERE_EN if s.lang == "en" else scenes.WHERE_ZH)[scene.sides[i]]
                )
            elif s.qtype == "color":
                assert name in s.question and part in (
                    f"{shape.color.capitalize()}.",
                    f"{scenes.COLORS_ZH[shape.color]}。",
                )
            else:  # shape, describe: the part names the shape (and, describing, its colour)
                assert name in part
        if s.qtype in ("color", "position"):  # the question names no other shape
            (i,) = [i for _, i in scene.subjects]
            assert not any(
                scenes.shape_name(o.kind, s.lang) in s.question for j, o in enumerate(scene.shapes) if j != i
            )
        seen.add((s.qtype, s.lang, len(scene.subjects), scene.subjects[-1][1]))
    for lang in ("en", "zh"):
        assert {("color", lang, 1, 1), ("position", lang, 1, 1), ("describe", lang, 2, 1)} <= seen


def _training_batch(n: int):
    """``n`` stage-2 training samples of the committed recipe as a batch, with the default model's tokenizer."""
    from tokenizers import Tokenizer

    from tools.train_default_model.batches import Encoder, Pixels, make_batch
    from tools.train_default_model.recipe import TrainConfig, draw
    from tools.train_default_model.vocabulary import SPECIAL_TOKENS

    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    enc = Encoder(tok, {t: tok.token_to_id(t) for t in SPECIAL_TOKENS})
    cfg = TrainConfig(batch_size=n, grounding_rate=0.4, shape_list_rate=0.1)
    drawn = [draw(cfg, cfg.easy_steps + 1, i) for i in range(n)]
    return drawn, make_batch([s for s, _ in drawn], enc, Pixels(MODEL_DIR, False)), enc


@needs_checkpoint
def test_pointer_queries_look_at_the_shape_the_text_is_about():
    from tools.train_default_model.dense_targets import MIN_COVER, shape_cover
    from tools.train_default_model.pointer import pointer_queries

    drawn, batch, enc = _training_batch(64)
    grids = batch["image_grid_thw"].tolist()
    image_rows = [row for row, (s, _) in enumerate(drawn) if s.image is not None]

    def shape_tokens(row: int, shape: int) -> list[int]:
        cover = shape_cover(drawn[row][1], grids[image_rows.index(row)])[shape]
        image_pos = (batch["input_ids"][row] == enc.ids["<|image_pad|>"]).nonzero().squeeze(1)
        want = np.flatnonzero(cover >= MIN_COVER) if cover.max() >= MIN_COVER else [cover.argmax()]
        return image_pos[list(want)].tolist()

    # One query per answer token (its final <|im_end|> included), at the token before it.
    by_row: dict[int, list] = {}
    for q in pointer_queries(drawn, batch, enc):
        by_row.setdefault(q.row, []).append(q)
    about = [row for row, (s, sc) in enumerate(drawn) if s.qtype not in ("count", "chat") and sc.subjects]
    assert sorted(by_row) == about
    pairs = formats = 0
    for row, qs in by_row.items():
        sample, scene = drawn[row]
        answer_at = (batch["labels"][row] != -100).nonzero().squeeze(1).tolist()
        assert [q.pos + 1 for q in qs] == answer_at
        assert all(q.targets.tolist() == shape_tokens(row, q.shape) for q in qs)  # the shape they show, named
        if sample.qtype in ("ground", "json"):  # each object's tokens look at its shape, in answer order
            formats += 1
            starts = enc.answer_starts(sample.answer)
            for q, char in zip(qs, starts, strict=True):
                shape = [i for start, i in scene.subjects if start <= char][-1]
                assert q.targets.tolist() == shape_tokens(row, shape)
        elif sample.qtype in ("color", "position"):  # the named shape throughout
            (named,) = [i for _, i in scene.subjects]
            assert all(q.targets.tolist() == shape_tokens(row, named) for q in qs)
        elif len(scene.shapes) == 2:  # a description: the left shape first, the right one from " and "/"和" on
            pairs += 1
            assert qs[0].targets.tolist() == shape_tokens(row, 0) != shape_tokens(row, 1) == qs[-1].targets.tolist()
            switch = [i for i, q in enumerate(qs) if q.targets.tolist() == shape_tokens(row, 1)][0]
            said = enc.tok.decode(batch["input_ids"][row, answer_at[0] : answer_at[switch]].tolist())
            assert scenes.shape_name(scene.shapes[0].kind, sample.lang) in said
            assert scenes.shape_name(scene.shapes[1].kind, sample.lang) not in said
        else:
            assert all(q.targets.tolist() == shape_tokens(row, 0) for q in qs)
    assert pairs >= 1 and formats >= 1


@needs_checkpoint
def test_attention_pointer_loss_is_the_attention_mass_transformers_computes():
    """The pointer loss re-derives one head's attention from captured layer inputs; it must equal minus the log
    of the attention mass transformers' own eager attention puts on the targets."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from tools.train_default_model.pointer import AttentionPointer, pointer_queries

    drawn, batch, enc = _training_batch(12)
    model = Qwen3VLForConditionalGeneration.from_pretrained(
        str(MODEL_DIR), dtype=torch.float32, attn_implementation="eager"
    )
    layer = 2
    pointer = AttentionPointer(model.model.language_model.layers[layer].self_attn)
    queries = pointer_queries(drawn, batch, enc)
    with torch.no_grad():
        out = model(**{k: v for k, v in batch.items() if k != "labels"}, output_attentions=True)
        got = pointer.loss(queries)
    attn = out.attentions[layer]  # (B, heads, L, L)
    want = torch.stack([-attn[q.row, 0, q.pos, q.targets].sum().log() for q in queries]).mean()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_held_out_set_is_disjoint_from_training():
    held = scenes.held_out_samples(50)
    train = [scenes.sample(scenes.train_rng(0, i)) for i in range(300)]
    train_images = {s.image.tobytes() for s in train if s.image is not None}
    assert not any(s.image is not None and s.image.tobytes() in train_images for s in held)


# ------------------------------------------------------------------------------------------------------------
# Checkpoint files


@needs_checkpoint
def test_checkpoint_is_small_and_complete():
    names = {p.name for p in MODEL_DIR.iterdir()}
    for required in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "generation_config.json",
        "chat_template.jinja",
        "README.md",
    ):
        assert required in names, f"{required} missing from the default model"
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert total <= 25 * 2**20, f"default model is {total / 2**20:.1f} MiB (limit 25)"


@needs_checkpoint
def test_config_is_a_real_qwen3_vl_architecture():
    from safetensors import safe_open

    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert cfg["model_type"] == "qwen3_vl"
    assert cfg["tie_word_embeddings"] is True
    assert len(cfg["vision_config"]["deepstack_visual_indexes"]) == 3
    rope = cfg["text_config"]["rope_parameters"]
    assert rope["mrope_interleaved"] is True and sum(rope["mrope_section"]) * 2 == cfg["text_config"]["head_dim"]
    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        n_params = sum(int(np.prod(f.get_slice(k).get_shape())) for k in keys)
        dtypes = {str(f.get_tensor(k).dtype) for k in list(keys)[:5]}
    assert "lm_head.weight" not in keys, "tied: lm_head is the embedding"
    assert any(k.startswith("model.visual.deepstack_merger_list.2.") for k in keys)
    assert 1_000_000 <= n_params <= 10_000_000
    assert dtypes <= {"torch.bfloat16", "torch.float16"}


@needs_checkpoint
def test_tokenizer_specials_template_and_generation_defaults():
    from tokenizers import Tokenizer

    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in QWEN_SPECIALS}
    assert None not in ids.values(), ids
    assert cfg["image_token_id"] == ids["<|image_pad|>"]
    assert cfg["video_token_id"] == ids["<|video_pad|>"]
    assert cfg["vision_start_token_id"] == ids["<|vision_start|>"]
    assert cfg["vision_end_token_id"] == ids["<|vision_end|>"]
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert gen["do_sample"] is False
    # Every Chinese string of the data set tokenizes into tokens that are whole characters each.
    for text in scenes.all_texts():
        for tid in tok.encode(text).ids:
            assert "\ufffd" not in tok.decode([tid]), (text, tid)


@needs_checkpoint
def test_chat_template_renders_qwen3_vl_chatml():
    from orin_vlm_node.processing import ChatTemplate

    template = ChatTemplate.from_pretrained(MODEL_DIR)
    assert not template.is_builtin
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What shape is this?"}]},
        {"role": "assistant", "content": "A star."},
        {"role": "user", "content": "你好"},
    ]
    assert template.render(messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What shape is this?<|im_end|>\n"
        "<|im_start|>assistant\nA star.<|im_end|>\n"
        "<|im_start|>user\n你好<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
