"""The benchmarks' talkative checkpoints: greedy answers that never end and stream one delta per token.

Why it matters: the ROS benchmark needs long answers through the node (which takes no ``ignore_eos``), and
the paged benchmark steps engines one streamed delta at a time so their k-th tokens are computed side by
side; a model whose text holds back incomplete characters would stream stretches of tokens in one delta.
"""

from __future__ import annotations

from bench.prompts import text_of_tokens
from bench.vs_transformers import greedy, make_engine
from orin_vlm_node.engine.events import Finished, Request, TextDelta, Turn
from support.checkpoints import ENDOFTEXT, IM_END, make_tiny_checkpoint, mute_ids
from support.tokenizer import SPECIAL_TOKENS, build_tiny_tokenizer


def test_muted_ids_are_exactly_those_without_whole_characters():
    muted = set(mute_ids(1024))
    assert {ENDOFTEXT, IM_END} | set(SPECIAL_TOKENS.values()) <= muted
    tokenizer = build_tiny_tokenizer()
    assert set(range(tokenizer.get_vocab_size(), 1024)) <= muted  # ids the tokenizer lacks decode to nothing
    halves = tokenizer.encode("ж").ids  # a 2-byte character the tiny corpus lacks: one byte token each
    assert len(halves) == 2 and set(halves) <= muted
    for i in set(range(1024)) - muted:
        text = tokenizer.decode([i], skip_special_tokens=True)
        assert text and "\ufffd" not in text


def test_talkative_answer_runs_to_its_limit_one_delta_per_token(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "ckpt", layers=2, tie=False, talkative=True)
    engine = make_engine(model_dir, "fp32", prefix_caching=False, max_context_tokens=2048)
    for prompt in ("Describe this image in detail.", text_of_tokens(model_dir, 600)):
        events = list(engine.generate(Request(turn=Turn(text=prompt), sampling=greedy(96))))  # EOS not ignored
        finished = events[-1]
        deltas = [e for e in events if isinstance(e, TextDelta)]
        assert isinstance(finished, Finished) and finished.finish_reason == "length"
        assert len(finished.token_ids) == 96
        assert [len(d.token_ids) for d in deltas] == [1] * 96
        assert "".join(d.text for d in deltas) == finished.text
