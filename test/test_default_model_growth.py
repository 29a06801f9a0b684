"""Training parts of the default model's grounding recipe (``tools/train_default_model``): ``presence.py`` marks
the last prompt token of every asked label (checked against the plain text of the tokens there) with whether the
answer lists it; ``decisions.py`` finds the answer tokens that decide a grounding answer (whether an object
follows, which label names it: checked against the answer's JSON) and scores them by torch's cross-entropy; a
fine-tune keeps its base's tokenizer, template and model config and reads pictures at its own recipe's
resolution (checked through the runtime's image processor); a run resumed from its snapshot continues its
learning-rate schedule once it has warmed up again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from orin_vlm_node.processing import ImageProcessor
from tools.train_default_model.batches import Encoder, Pixels, make_batch
from tools.train_default_model.decisions import decision_loss, decision_positions
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


def test_decision_tokens_are_where_a_grounding_answer_chooses_its_objects_and_labels(parts):
    tok, enc, drawn, batch = parts
    rows, positions = decision_positions(drawn, batch, enc)
    for row, (sample, _) in enumerate(drawn):
        mine = [p for r, p in zip(rows.tolist(), positions.tolist(), strict=True) if r == row]
        chosen = [tok.id_to_token(int(batch["labels"][row, p])) for p in mine]
        if sample.qtype != "ground":
            assert not chosen
            continue
        objects = json.loads(sample.answer)
        # per object: "{" (the first) or "," (the next), then its label's first character; "]" closes the list
        expected = [ch for i, obj in enumerate(objects) for ch in ("{" if i == 0 else ",", obj["label"][0])] + ["]"]
        assert [t[0] for t in chosen] == (expected if objects else ["]"]), (sample.answer, chosen)
    logits = torch.randn(*batch["input_ids"].shape, tok.get_vocab_size(), generator=torch.Generator().manual_seed(0))
    picked = logits[rows, positions - 1]  # position p - 1 predicts token p
    want = torch.nn.functional.cross_entropy(picked, batch["labels"][rows, positions])
    assert torch.allclose(decision_loss(logits, drawn, batch, enc), want)
    assert decision_loss(logits, [(s, sc) for s, sc in drawn if s.qtype != "ground"], batch, enc) is None


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
