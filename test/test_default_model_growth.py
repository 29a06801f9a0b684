"""Training parts of the default model's grounding recipe (``tools/train_default_model``): ``presence.py`` marks
the last prompt token of every asked label (checked against the plain text of the tokens there) with whether the
answer lists it; a fine-tune keeps its base's tokenizer, template and model config and reads pictures
at its own recipe's resolution (checked through the runtime's image processor); a run resumed from its snapshot
continues its learning-rate schedule once it has warmed up again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from orin_vlm_node.processing import ImageProcessor
from tools.train_default_model.batches import Encoder, Pixels, make_batch
from tools.train_default_model.presence import presence_targets
from tools.train_default_model.recipe import TrainConfig, draw, lr_at
from tools.train_default_model.training import copy_checkpoint_skeleton
from tools.train_default_model.vocabulary import SPECIAL_TOKENS

MODEL_DIR = Path(__file__).resolve().parent.parent / "orin_vlm_node" / "default_model"

pytestmark = pytest.mark.skipif(
    not (MODEL_DIR / "model.safetensors").is_file(), reason="default model checkpoint not built"
)


@pytest.fixture(scope="module")
def parts():
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    enc = Encoder(tok, {t: tok.token_to_id(t) for t in SPECIAL_TOKENS})
    drawn = [draw(TrainConfig(grounding_rate=0.6, easy_steps=0), 3, i) for i in range(8)]
    batch = make_batch([s for s, _ in drawn], enc, Pixels(MODEL_DIR, False))
    return tok, enc, drawn, batch


def test_presence_targets_mark_each_asked_label_with_whether_the_answer_lists_it(parts):
    tok, enc, drawn, batch = parts
    rows, positions, present = presence_targets(drawn, batch, enc)
    grounding = [row for row, (s, _) in enumerate(drawn) if s.qtype == "ground"]
    assert sorted(set(rows.tolist())) == grounding and len(grounding) >= 2
    marked = iter(zip(rows.tolist(), positions.tolist(), present.tolist(), strict=True))
    for row in grounding:
        sample = drawn[row][0]
        listed = {obj["label"] for obj in json.loads(sample.answer)}
        labels = sample.question.split(": ", 1)[1].split(". Report")[0].split(", ")
        for label in (name.strip('"') for name in labels):
            r, pos, shown = next(marked)
            ids = batch["input_ids"][row]
            assert r == row and shown == float(label in listed)
            assert tok.decode(ids[: pos + 1].tolist()).endswith(label)
            assert not tok.decode(ids[:pos].tolist()).endswith(label)


def test_a_fine_tune_keeps_its_bases_files_and_reads_pictures_at_its_own_resolution(tmp_path):
    cfg = TrainConfig(image_tokens_min=64, image_tokens_max=64)
    tok, ids = copy_checkpoint_skeleton(cfg, MODEL_DIR, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        assert (tmp_path / name).read_bytes() == (MODEL_DIR / name).read_bytes(), name
    assert ids == {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    base, tuned = ImageProcessor.from_pretrained(MODEL_DIR), ImageProcessor.from_pretrained(tmp_path)
    for h, w in ((64, 64), (160, 160), (80, 160), (720, 1280)):
        assert 54 <= tuned.num_image_tokens(h, w) <= 76, (h, w)  # about 64: rounded to whole tokens per side
        assert tuned.num_image_tokens(h, w) > base.num_image_tokens(h, w), (h, w)  # the base reads about 36
    video = json.loads((tmp_path / "video_preprocessor_config.json").read_text())
    assert video == json.loads((MODEL_DIR / "video_preprocessor_config.json").read_text())  # clips as before


def test_a_resumed_run_continues_the_schedule_after_warming_up_again():
    run = TrainConfig(steps=5000, warmup_steps=100)
    resumed = TrainConfig(steps=5000, warmup_steps=100, start_step=1500)
    assert lr_at(1500, resumed) == pytest.approx(lr_at(1500, run) / 100)  # moments from zero: small steps first
    assert lr_at(1549, resumed) == pytest.approx(lr_at(1549, run) / 2)
    for step in (1599, 2500, 4999):
        assert lr_at(step, resumed) == pytest.approx(lr_at(step, run))
