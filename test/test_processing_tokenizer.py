"""Tokenizer wrapper against transformers' tokenizer loaded from the same files (tiny byte-level BPE)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFBackend
from tokenizers import models, pre_tokenizers
from transformers import AutoTokenizer

from orin_vlm_node.processing import Tokenizer, TokenizerError
from support.tokenizer import SPECIAL_TOKENS, write_tiny_tokenizer

TEXTS = [
    "Describe this image.",
    "请描述这张图片。机器人在哪里？",
    "Emoji 😀🤖 and a family 👨‍👩‍👧‍👦 plus flags 🇨🇳🇺🇸",
    "Mixed 混合 text with unseen words: xylophone Ωmega ñandú",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def hf_tok(tiny_dir):
    return AutoTokenizer.from_pretrained(str(tiny_dir))


def test_tiny_tokenizer_fixed_ids_and_determinism(tmp_path):
    ids_a = write_tiny_tokenizer(tmp_path / "a")
    write_tiny_tokenizer(tmp_path / "b")
    assert ids_a == SPECIAL_TOKENS
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    tok = Tokenizer.from_pretrained(tmp_path / "a")
    assert tok.vocab_size <= 1024  # fits the tiny checkpoints' embedding table


def test_special_ids_looked_up(tiny_dir):
    tok = Tokenizer.from_pretrained(tiny_dir)
    s = tok.special
    got = {
        "<|endoftext|>": s.endoftext,
        "<|im_start|>": s.im_start,
        "<|im_end|>": s.im_end,
        "<|vision_start|>": s.vision_start,
        "<|vision_end|>": s.vision_end,
        "<|image_pad|>": s.image_pad,
        "<|video_pad|>": s.video_pad,
    }
    assert got == {k: v for k, v in SPECIAL_TOKENS.items() if k in got}
    assert tok.eos_token_ids == (s.im_end, s.endoftext)  # no generation_config.json


def test_special_ids_follow_the_tokenizer_not_constants(tmp_path):
    """A tokenizer whose special tokens sit at other ids: ids come from the vocabulary."""
    backend = HFBackend(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(list(reversed(SPECIAL_TOKENS)))
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.special.im_start == backend.token_to_id("<|im_start|>") != SPECIAL_TOKENS["<|im_start|>"]
    assert tok.special.image_pad == backend.token_to_id("<|image_pad|>")
    assert tok.encode("a <|image_pad|> b") == [0, backend.token_to_id("<|image_pad|>"), 1]


def test_missing_special_token_and_files(tmp_path):
    backend = HFBackend(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="vision_start"):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path / "missing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{oops")
    with pytest.raises(TokenizerError, match="cannot load"):
        Tokenizer.from_pretrained(tmp_path / "bad")


def test_eos_ids_from_generation_config(tiny_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == (2, 0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(TokenizerError, match="eos_token_id"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5000]}))
    with pytest.raises(TokenizerError, match="outside"):
        Tokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tiny_dir, hf_tok, text):
    tok = Tokenizer.from_pretrained(tiny_dir)
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert ids == hf_tok(text)["input_ids"]  # transformers adds nothing either: no BOS for Qwen
    assert tok.decode(ids) == text  # byte-level BPE is lossless
    assert tok.decode(ids) == hf_tok.decode(ids)


def test_special_tokens_in_text(tiny_dir, hf_tok):
    tok = Tokenizer.from_pretrained(tiny_dir)
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi 你好<|im_end|>\n"
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    s = tok.special
    assert ids[0] == s.im_start and ids.count(s.image_pad) == 1 and s.im_end in ids
    assert ids[ids.index(s.vision_start) + 1] == s.image_pad
    assert tok.decode(ids) == text
    assert (
        tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True) == "user\nhi 你好\n"
    )
    with pytest.raises(TokenizerError, match="str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]
