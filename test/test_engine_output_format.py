"""Answers constrained to a format: every answer matches it (checked with Python's json and re, not with the
matcher), greedy decoding takes the most likely token the format allows (torch math over the model's own
logits, the allowed set from a matcher built apart from the engine's), requests with different formats
decode together as they do alone (also with the static step overlapping as on a GPU), an answer cut short
says it is incomplete, a bad format is one request's error, and a session's constrained turn reuses its KV."""

from __future__ import annotations

import json
import re

import llguidance
import pytest
import torch

from orin_vlm_node.engine import Engine, EngineConfig, Finished, Request, SamplingParams, Turn, output_format
from orin_vlm_node.engine.assemble import MAX_BATCH
from orin_vlm_node.engine.decode_step import StaticDecodeStep
from orin_vlm_node.engine.output_format import JSON_OPTIONS
from orin_vlm_node.processing.prompt import build_prompt_ids
from support.checkpoints import cached_tiny_checkpoint

torch.set_num_threads(1)

SCHEMA = {
    "type": "object",
    "properties": {
        "shape": {"enum": ["circle", "square"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 20},
        "open": {"type": "boolean"},
    },
    "required": ["shape", "count", "open"],
    "additionalProperties": False,
}
FORMATS = {
    "choice": output_format("choice", ["yes", "no", "not sure"]),
    "regex": output_format("regex", r"[0-9]{1,2} (boxes|cups)"),
    "json": output_format("json_schema", SCHEMA),
}


def matches(kind: str, text: str) -> bool:
    """Whether ``text`` is an answer of the format ``kind``, by Python's own json and re."""
    if kind == "choice":
        return text in ("yes", "no", "not sure")
    if kind == "regex":
        return re.fullmatch(r"[0-9]{1,2} (boxes|cups)", text) is not None
    value = json.loads(text)
    return (
        set(value) == {"shape", "count", "open"}
        and value["shape"] in ("circle", "square")
        and type(value["count"]) is int
        and 0 <= value["count"] <= 20
        and type(value["open"]) is bool
        and text == json.dumps(value, separators=(",", ":"))  # compact: no whitespace anywhere
    )


@pytest.fixture(scope="module", params=["dynamic", "overlap"])
def engine(request) -> Engine:
    engine = Engine(EngineConfig(model_path=str(cached_tiny_checkpoint()), device="cpu", max_batch=4))
    if request.param == "overlap":
        engine.parts.decode_step = StaticDecodeStep(
            engine.parts.model, engine.parts.cache, torch.device("cpu"), False, max_batch=MAX_BATCH, overlap=True
        )
    return engine


def ask(engine: Engine, kind: str, temperature: float = 0.0, seed: int = 0, n: int = 48, **kw) -> Finished:
    sampling = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=n)
    return list(
        engine.generate(Request(Turn("How many boxes are on the shelf?"), sampling, output=FORMATS[kind], **kw))
    )[-1]


@pytest.mark.parametrize("kind", list(FORMATS))
def test_greedy_and_sampled_answers_match_the_format_and_end_when_it_is_complete(engine, kind):
    for temperature, seed in ((0.0, 0), (1.0, 1), (1.0, 2), (1.5, 3)):
        final = ask(engine, kind, temperature, seed)
        assert final.finish_reason == "stop" and final.error is None, final
        assert matches(kind, final.text), final.text
        assert final.output["complete"] is True
        value = json.loads(final.text) if kind == "json" else final.text
        assert final.output["value"] == value
        assert final.output["format"] == FORMATS[kind].describe()


@pytest.mark.parametrize("kind", list(FORMATS))
def test_greedy_takes_the_most_likely_token_the_format_allows(engine, kind):
    """Teacher-forced over the answer: the model's logits at each step (torch), the tokens a matcher built
    from tokenizer.json allows there; the answer's token is the allowed argmax every time."""
    final = ask(engine, kind)
    parts = engine.parts
    messages = [{"role": "user", "content": [{"type": "text", "text": "How many boxes are on the shelf?"}]}]
    prompt = build_prompt_ids(parts.tokenizer, parts.turns.renderer.template, messages, [])
    ids = prompt + list(final.token_ids)
    seq = parts.cache.new_sequence()
    n = len(ids)
    positions, rows = torch.arange(n).expand(3, -1), torch.arange(n)
    logits = parts.model.forward(torch.tensor(ids), positions, parts.cache.step(seq, n), logits_index=rows)
    parts.cache.release(seq)
    vocab = logits.shape[-1]
    table = llguidance.LLTokenizer(
        str(cached_tiny_checkpoint() / "tokenizer.json"), n_vocab=vocab, eos_token=list(parts.tokenizer.eos_token_ids)
    )
    fmt = FORMATS[kind]
    grammar = {
        "choice": lambda: llguidance.grammar_from("choice", list(fmt.spec)),
        "regex": lambda: llguidance.LLMatcher.grammar_from_regex(fmt.spec),
        "json": lambda: llguidance.LLMatcher.grammar_from_json_schema(fmt.spec, defaults=JSON_OPTIONS),
    }[kind]()
    matcher = llguidance.LLMatcher(table, grammar)
    for i, token in enumerate(final.token_ids):
        words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32).tolist()
        allowed = torch.tensor([(words[t // 32] >> (t % 32)) & 1 for t in range(vocab)], dtype=torch.bool)
        row = logits[len(prompt) - 1 + i].masked_fill(~allowed, float("-inf"))
        assert int(row.argmax()) == token, i
        assert matcher.consume_token(token)
    assert matcher.is_stopped()


def test_requests_with_different_formats_decode_together_as_alone(engine):
    kinds = ["json", "choice", "regex", None]
    requests = [
        Request(
            Turn(f"Question {i}: what is on the table?"),
            SamplingParams(temperature=0.0, max_new_tokens=40),
            output=FORMATS[k] if k else None,
            request_id=f"r{i}",
        )  # fmt: skip
        for i, k in enumerate(kinds)
    ]
    alone = [list(engine.generate(r))[-1] for r in requests]
    streams = [engine.generate(r) for r in requests]
    finals: list[Finished | None] = [None] * len(streams)
    while any(f is None for f in finals):
        for i, stream in enumerate(streams):
            if finals[i] is None:
                event = next(stream)
                finals[i] = event if isinstance(event, Finished) else None
    assert max(f.metrics["batch_size"] for f in finals) > 1
    for kind, final, reference in zip(kinds, finals, alone, strict=True):
        assert final.token_ids == reference.token_ids and final.output == reference.output
        assert kind is None or matches(kind, final.text)
    assert finals[-1].output is None  # free text stays free


def test_an_answer_cut_by_max_new_tokens_says_it_is_incomplete(engine):
    final = ask(engine, "json", n=4)
    assert final.finish_reason == "length" and final.error is None
    assert final.output == {"format": "json_schema", "complete": False, "value": None}
    assert len(final.token_ids) == 4


@pytest.mark.parametrize(
    "kind, spec, message",
    [
        ("regex", "([", "invalid regex: "),  # does not compile: the library's reason
        ("regex", r"a\bb", "lookarounds not supported"),  # a feature the library cannot compile, named
        ("regex", r"[^\s\S]", "regex can never match"),
        ("regex", "x{5000000}", "the output format failed at token"),  # past the library's lexer limits
        ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "invalid json_schema: "),
    ],
)
def test_a_format_that_cannot_work_is_that_request_s_error_and_the_engine_goes_on(engine, kind, spec, message):
    bad = Request(Turn("Hi."), SamplingParams(max_new_tokens=4), output=output_format(kind, spec))
    final = list(engine.generate(bad))[-1]
    assert final.finish_reason == "error" and message in final.error and "\n" not in final.error
    assert final.output is None
    assert matches("choice", ask(engine, "choice").text)


@pytest.mark.parametrize(
    "kind, spec, message",
    [
        ("xml", "<a/>", "output format kind must be one of json_schema, regex, choice"),
        ("json_schema", "{not json", "json_schema is not valid JSON"),
        ("json_schema", [1], "json_schema must be a JSON object"),
        ("regex", "", "regex must be a non-empty string"),
        ("choice", ["yes", ""], "choice needs a list of non-empty strings"),
        ("choice", "yes", "choice needs a list of non-empty strings"),
    ],
)
def test_a_malformed_format_is_refused_naming_why(kind, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        output_format(kind, spec)


def test_a_session_s_constrained_turns_reuse_its_kv_and_the_prefix_cache(engine):
    first = ask(engine, "choice", session_id="s")
    second = ask(engine, "json", session_id="s")
    assert matches("choice", first.text) and matches("json", second.text)
    # The history came from the session's KV: only the new turn was computed.
    assert second.metrics["prefill_tokens"] < second.metrics["prompt_tokens"]
    engine.reset("s")
    again = [ask(engine, "regex") for _ in range(2)]
    assert again[0].token_ids == again[1].token_ids
    assert again[1].metrics["prefix_hit_tokens"] > 0  # the same prompt: its blocks came from the prefix cache


def test_a_format_that_takes_too_long_to_compile_is_refused_and_the_next_one_compiles(engine):
    """A bound of a microsecond: a 200-property schema takes milliseconds, so it is refused, not waited for."""
    from orin_vlm_node.engine.output_format import Grammars

    parts = engine.parts
    schema = {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(200)}}
    hurried = Grammars(parts.tokenizer, parts.model_config.text.vocab_size, compile_timeout_s=1e-6)
    with pytest.raises(ValueError, match=r"json_schema took more than 1e-06 s to compile: refused"):
        hurried.compile(output_format("json_schema", schema))
    patient = Grammars(parts.tokenizer, parts.model_config.text.vocab_size)
    assert patient.compile(output_format("json_schema", schema)).format.kind == "json_schema"
