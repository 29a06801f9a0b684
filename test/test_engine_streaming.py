"""Streaming through the engine: deltas concatenate to the final text, multi-byte characters split
across tokens arrive whole, stop strings cut the text, EOS ends with "stop".

A random model produces arbitrary byte soup, so these tests use a *scripted* checkpoint: the tiny
checkpoint with attention and MLP outputs zeroed (the residual stream is just the token embedding)
and embeddings/lm_head set so token ``chain[i]`` predicts ``chain[i+1]``. Greedy or sampled, the model
then writes a known text whose tokens split CJK characters and emoji (checked below), ending in EOS.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from orin_vlm_node.engine import Engine, EngineConfig, Finished, Request, SamplingParams, TextDelta, Turn
from orin_vlm_node.processing import Tokenizer
from support.checkpoints import IM_END, cached_tiny_checkpoint

torch.set_num_threads(1)

SCRIPT = "Hello, 世界！🎉机器人🤖 Observation: done"


def make_scripted_checkpoint(dst: Path, text: str = SCRIPT, tail: tuple[int, ...] = ()) -> tuple[Path, list[int]]:
    """Copy the tiny checkpoint to ``dst`` and script it to answer ``text``, the ids ``tail`` (special
    tokens no text encodes to), then ``<|im_end|>``.

    Returns the directory and the chain of answer token ids. The chain starts at the last token of
    the generation prompt ("\\n" of ``<|im_start|>assistant\\n``), whatever came before it.
    """
    src = cached_tiny_checkpoint(layers=1, tie=False, deepstack=(0,), seed=11)
    shutil.copytree(src, dst)
    tok = Tokenizer.from_pretrained(dst)
    trigger = tok.encode("<|im_start|>assistant\n")[-1]
    answer = [*tok.encode(text), *tail]
    chain = [trigger, *answer, IM_END]
    assert len(set(chain)) == len(chain), "chain tokens must be distinct"
    weights = load_file(str(dst / "model.safetensors"))
    hidden = weights["model.language_model.norm.weight"].shape[0]
    assert len(chain) <= hidden
    for name in list(weights):
        if name.endswith("self_attn.o_proj.weight") or name.endswith("mlp.down_proj.weight"):
            weights[name] = torch.zeros_like(weights[name])
    weights["model.language_model.norm.weight"] = torch.ones(hidden)
    embed = weights["model.language_model.embed_tokens.weight"].clone()
    head = torch.zeros_like(weights["lm_head.weight"])
    for i, token in enumerate(chain[:-1]):
        embed[token] = torch.nn.functional.one_hot(torch.tensor(i), hidden).float()
        head[chain[i + 1], i] = 10.0  # RMSNorm scales the one-hot by sqrt(hidden): logit 80 vs 0
    weights["model.language_model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst, answer


@functools.lru_cache(maxsize=1)
def _scripted(root: str) -> tuple[str, list[int]]:
    path, answer = make_scripted_checkpoint(Path(root) / "scripted")
    return str(path), answer


def scripted_engine(tmp_path_factory, **overrides) -> tuple[Engine, list[int]]:
    path, answer = _scripted(str(tmp_path_factory.getbasetemp()))
    cfg = dict(model_path=path, max_context_tokens=256, page_size=4) | overrides
    return Engine(EngineConfig(**cfg)), answer


def finish_one(engine: Engine, request: Request) -> Finished:
    """The one Finished event of ``request``, checked to be the last and only one."""
    events = list(engine.generate(request))
    assert sum(isinstance(e, Finished) for e in events) == 1 and isinstance(events[-1], Finished)
    return events[-1]


def assert_healthy(engine: Engine) -> None:
    """Only sessions hold KV blocks after a request, and a normal request still works."""
    held = sum(len(engine.parts.cache.block_table(engine.parts.session_store.get(s).seq)) for s in engine.sessions())
    assert engine.parts.cache.stats()["blocks_used"] == held
    final = finish_one(engine, Request(Turn("Go."), SamplingParams(temperature=0.0, max_new_tokens=5)))
    assert final.finish_reason == "length", final.error
    assert final.text == "Hello, 世界！"


def _run(engine: Engine, request: Request) -> tuple[list[TextDelta], Finished]:
    events = list(engine.generate(request))
    assert all(isinstance(e, TextDelta) for e in events[:-1]) and isinstance(events[-1], Finished)
    return events[:-1], events[-1]


def test_deltas_concatenate_to_text_with_split_multibyte_characters(tmp_path_factory):
    engine, answer = scripted_engine(tmp_path_factory)
    tok = engine.parts.tokenizer
    split = [t for t in answer if "\ufffd" in tok.decode([t])]
    assert len(split) >= 3, "the script must contain tokens holding partial UTF-8 characters"
    for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3)):
        deltas, final = _run(engine, Request(Turn("Say hello."), sampling))
        assert final.finish_reason == "stop", final.error
        assert "".join(d.text for d in deltas) == final.text == SCRIPT
        assert all("\ufffd" not in d.text for d in deltas)
        assert list(final.token_ids) == [*answer, IM_END]  # the EOS that ended generation is reported
        streamed_ids = [t for d in deltas for t in d.token_ids]
        assert streamed_ids == answer
        # A split character is delivered once complete: the delta carrying 🎉 holds both its tokens.
        assert any("🎉" in d.text and len(d.token_ids) >= 2 for d in deltas)


def test_stop_strings_trim_text_and_finish_with_stop(tmp_path_factory):
    engine, answer = scripted_engine(tmp_path_factory, use_paged_attention=False)
    for stop, expected in [
        ("Observation:", "Hello, 世界！🎉机器人🤖 "),
        ("🎉", "Hello, 世界！"),
        ("人🤖", "Hello, 世界！🎉机器"),
    ]:
        deltas, final = _run(engine, Request(Turn("Go."), SamplingParams(temperature=0.0, stop=(stop,))))
        assert final.finish_reason == "stop"
        assert final.text == expected
        assert "".join(d.text for d in deltas) == expected
        assert len(final.token_ids) < len(answer) + 1  # stopped before the EOS


def test_max_new_tokens_finishes_with_length(tmp_path_factory):
    engine, answer = scripted_engine(tmp_path_factory)
    deltas, final = _run(engine, Request(Turn("Go."), SamplingParams(temperature=0.0, max_new_tokens=5)))
    assert final.finish_reason == "length"
    assert list(final.token_ids) == answer[:5]
    assert "".join(d.text for d in deltas) == final.text == "Hello, 世界！"
    assert final.metrics["generated_tokens"] == 5


def test_ignore_eos_generates_exactly_max_new_tokens(tmp_path_factory):
    """Benchmarks need answers of a fixed length: with ignore_eos the EOS token is generated and passed
    over (it carries no text), and the answer ends at max_new_tokens."""
    engine, answer = scripted_engine(tmp_path_factory)
    n = len(answer) + 6
    events = list(
        engine.generate(Request(Turn("Go."), SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)))
    )
    final = events[-1]
    assert final.finish_reason == "length" and len(final.token_ids) == n
    assert list(final.token_ids[: len(answer) + 1]) == [*answer, IM_END]
    assert final.text.startswith(SCRIPT) and "".join(e.text for e in events[:-1]) == final.text
    stopped = list(engine.generate(Request(Turn("Go."), SamplingParams(temperature=0.0, max_new_tokens=n))))[-1]
    assert stopped.finish_reason == "stop" and list(stopped.token_ids) == [*answer, IM_END]
