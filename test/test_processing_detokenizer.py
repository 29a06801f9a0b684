"""Streaming detokenizer: deltas concatenate to the full decode and never split a UTF-8 character."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orin_vlm_node.processing import IncrementalDetokenizer, Tokenizer
from support.tokenizer import write_tiny_tokenizer

TEXT = "机器人看到一只猫 🐱 和一个家庭 👨‍👩‍👧‍👦! Emoji 🤖🇨🇳 done. 你好，世界"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path: Path = tmp_path_factory.mktemp("detok")
    write_tiny_tokenizer(path)
    return Tokenizer.from_pretrained(path)


class _CountingTokenizer:
    """Delegates to the real tokenizer and records how many ids each decode call got."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self.window_sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=False):
        self.window_sizes.append(len(ids))
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream(tok, ids, skip_special_tokens=False) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


def _check_stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> None:
    deltas = _stream(tok, ids, skip_special_tokens)
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == full
    emitted = ""
    for step, delta in enumerate(deltas[:-1]):
        emitted += delta
        # What was emitted after `step + 1` tokens is final text: a prefix of the full decode, so a
        # U+FFFD in it is one the full decode has at the same place (never a split character) ...
        assert full.startswith(emitted)
        # ... and it only covers characters those tokens complete.
        assert tok.decode(ids[: step + 1], skip_special_tokens=skip_special_tokens).startswith(emitted)


def test_tiny_vocab_splits_characters(tok):
    """Guard for the tests below: the tiny vocab does cut multi-byte characters across tokens."""
    ids = tok.encode(TEXT)
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def _byte_token_ids(tok: Tokenizer) -> dict[int, int]:
    """UTF-8 byte value -> id of the tiny vocab's single-byte token (GPT-2 byte-to-unicode alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {b: tok.token_to_id(c) for b, c in chars.items()}


def test_real_text_never_emits_replacement_char(tok):
    ids = tok.encode(TEXT)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_one_token_per_byte(tok):
    """Worst case: every UTF-8 byte its own token; characters appear only once complete."""
    byte_ids = _byte_token_ids(tok)
    ids = [byte_ids[b] for b in TEXT.encode("utf-8")]
    assert tok.decode(ids) == TEXT
    deltas = _stream(tok, ids)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[:3] == ["", "", "机"]  # a 3-byte character completes on its third token


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_ids_concatenate_to_full_decode(tok, data):
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=0, max_size=40))
    _check_stream(tok, ids)


def test_random_ids_biased_to_partial_bytes(tok):
    """Random mixes of single-byte tokens (ids 8..263: lead and continuation bytes), whole-character
    tokens and special tokens, with and without skipping specials."""
    rng = random.Random(0)
    byte_tokens = list(range(8, 264))
    whole = tok.encode(TEXT)
    for _ in range(200):
        ids = [
            rng.choice(byte_tokens) if r < 0.6 else rng.choice(whole) if r < 0.9 else rng.randrange(8)
            for r in (rng.random() for _ in range(rng.randrange(1, 30)))
        ]
        _check_stream(tok, ids)
        _check_stream(tok, ids, skip_special_tokens=True)


def test_windows_stay_small(tok):
    """Each push decodes only the few ids since the last emitted chunk (not the whole sequence)."""
    ids = tok.encode(TEXT * 30)
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting)  # type: ignore[arg-type]
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == TEXT * 30
    assert len(ids) > 500 and max(counting.window_sizes) <= 8


def test_flush_returns_incomplete_tail_once(tok):
    byte_ids = _byte_token_ids(tok)
    a, lead = byte_ids[ord("a")], byte_ids["你".encode()[0]]
    detok = IncrementalDetokenizer(tok)
    assert detok.push(a) == "a"
    assert detok.push(lead) == ""  # held back: could be the start of a character
    assert detok.flush() == "\ufffd" == tok.decode([a, lead])[1:]  # stream ended inside a character
    assert detok.flush() == ""
    assert detok.token_ids == [a, lead]
