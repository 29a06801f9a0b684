"""The default model's coordinates as single tokens (``tools/train_default_model/numbers.py``): every integer of
Qwen3-VL's 0..1000 grid is one token whatever merges apply first, text without digits tokenizes as before,
the number rows start as smooth functions of their value, and the smoothed loss is the cross-entropy
against a Gaussian over the numbers (checked against the same math written out in torch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from support import synthetic_scenes as scenes
from tools.train_default_model.numbers import (
    NUMBER_MAX,
    add_number_tokens,
    init_number_embeddings,
    number_ids,
    padded_vocab,
    smoothed_number_loss,
)

TOKENIZER = Path(__file__).resolve().parent.parent / "orin_vlm_node" / "default_model" / "tokenizer.json"


@pytest.fixture(scope="module")
def tokenizers() -> tuple[Tokenizer, Tokenizer]:
    base = Tokenizer.from_file(str(TOKENIZER))
    data = json.loads(base.to_str())
    for token in [t for t in data["model"]["vocab"] if t.isdigit() and len(t) > 1]:  # a tokenizer without them
        del data["model"]["vocab"][token]
    data["model"]["merges"] = [m for m in data["model"]["merges"] if not "".join(m).isdigit()]
    plain = Tokenizer.from_str(json.dumps(data))
    return plain, add_number_tokens(plain)


def test_every_integer_of_the_grid_is_one_token_and_decodes_back(tokenizers):
    _, numbered = tokenizers
    ids = number_ids(numbered)
    assert len(set(ids.tolist())) == NUMBER_MAX + 1
    assert [numbered.decode([int(i)]) for i in ids] == [str(n) for n in range(NUMBER_MAX + 1)]
    answer = '[{"bbox_2d": [12, 305, 1000, 999], "label": "red circle"}, {"point_2d": [0, 7], "label": "star"}]'
    encoded = numbered.encode(answer).ids
    assert numbered.decode(encoded) == answer
    digits = [numbered.id_to_token(i) for i in encoded if numbered.id_to_token(i).isdigit()]
    assert digits == ["2", "12", "305", "1000", "999", "2", "0", "7"]  # "bbox_2d"'s 2, then one token a number
    assert add_number_tokens(numbered).to_str() == numbered.to_str()  # added once


def test_text_without_digits_tokenizes_as_before(tokenizers):
    plain, numbered = tokenizers
    for text in scenes.all_texts():
        assert numbered.encode(text).ids == plain.encode(text).ids, text
    assert padded_vocab(numbered.get_vocab_size()) % 64 == 0 >= padded_vocab(1) - 64


def test_number_rows_start_smooth_at_the_norm_of_the_others():
    gen = torch.Generator().manual_seed(0)
    embedding = torch.randn(1200, 32, generator=gen)
    ids = torch.arange(100, 100 + NUMBER_MAX + 1)
    others = embedding[torch.cat([torch.arange(100), torch.arange(100 + NUMBER_MAX + 1, 1200)])].norm(dim=1).mean()
    init_number_embeddings(embedding, ids, seed=0)
    rows = torch.nn.functional.normalize(embedding[ids], dim=1)
    similarity = rows @ rows[500]
    assert similarity[505] > similarity[530] > similarity[600] > similarity[800].abs()
    assert torch.allclose(embedding[ids].norm(dim=1), torch.full((NUMBER_MAX + 1,), float(others)), rtol=1e-5)


def test_the_smoothed_loss_is_the_cross_entropy_against_a_gaussian_over_the_numbers():
    gen = torch.Generator().manual_seed(1)
    vocab, ids = 1100, torch.arange(50, 50 + NUMBER_MAX + 1)
    logits = torch.randn(2, 6, vocab, generator=gen)
    labels = torch.full((2, 6), -100)
    labels[0, 2], labels[0, 3], labels[1, 5] = ids[300], 7, ids[0]  # two numbers, one other token
    sigma = 10.0
    want = []
    for row, pos, value in ((0, 1, 300), (1, 4, 0)):  # the logits one position before each label
        logp = torch.log_softmax(logits[row, pos], dim=-1)[ids]
        grid = torch.arange(NUMBER_MAX + 1, dtype=torch.float32)
        target = torch.exp(-0.5 * ((grid - value) / sigma) ** 2)
        want.append(-(target / target.sum() * logp).sum())
    assert smoothed_number_loss(logits, labels, ids, sigma) == pytest.approx(float(torch.stack(want).mean()), rel=1e-5)
    assert smoothed_number_loss(logits, torch.full((2, 6), -100), ids, sigma) == 0.0
