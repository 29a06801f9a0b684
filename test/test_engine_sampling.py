"""Sampler: parameter layering and validation, transformers-equivalent logits processing, and the
statistics of seeded sampling on fixed logits (expected distributions computed by hand)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from orin_vlm_node.engine.events import SamplingParams
from orin_vlm_node.engine.sampling import (
    Sampler,
    apply_penalties,
    filter_logits,
    load_generation_defaults,
    resolve_sampling,
    validate_sampling,
)

# Probabilities chosen so truncation sets are easy to reason about by hand.
PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.05])
LOGITS = PROBS.log()
N_DRAWS = 20000


def _params(**kw) -> object:
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, seed=0)
    base.update(kw)
    return resolve_sampling(SamplingParams(**base))


def _empirical(params, logits=LOGITS) -> torch.Tensor:
    sampler = Sampler(params)
    draws = sampler.sample(logits.expand(N_DRAWS, -1))
    return torch.bincount(draws, minlength=logits.numel()).float() / N_DRAWS


def _assert_matches(freq: torch.Tensor, expected: torch.Tensor) -> None:
    """Zero where expected is zero; elsewhere within 5 binomial standard deviations."""
    for i, (f, p) in enumerate(zip(freq.tolist(), expected.tolist(), strict=True)):
        if p == 0.0:
            assert f == 0.0, f"token {i} must never be drawn, got frequency {f}"
        else:
            sigma = math.sqrt(p * (1 - p) / N_DRAWS)
            assert abs(f - p) <= 5 * sigma, f"token {i}: frequency {f:.4f}, expected {p:.4f}"


def test_plain_sampling_follows_softmax():
    _assert_matches(_empirical(_params()), PROBS)


def test_top_k_keeps_k_most_likely():
    expected = torch.tensor([0.4, 0.25, 0.15, 0, 0, 0]) / 0.8
    _assert_matches(_empirical(_params(top_k=3)), expected)


def test_top_p_keeps_smallest_set_reaching_mass():
    # 0.4 + 0.25 = 0.65 < 0.7, so 0.15 is still needed; with it the mass is 0.8 >= 0.7 and 0.1 goes.
    expected = torch.tensor([0.4, 0.25, 0.15, 0, 0, 0]) / 0.8
    _assert_matches(_empirical(_params(top_p=0.7)), expected)
    # top_p below the largest probability keeps only the argmax.
    _assert_matches(_empirical(_params(top_p=0.3)), torch.tensor([1.0, 0, 0, 0, 0, 0]))


def test_min_p_drops_tokens_below_fraction_of_max():
    # threshold 0.5 * 0.4 = 0.2: keeps 0.4 and 0.25.
    expected = torch.tensor([0.4, 0.25, 0, 0, 0, 0]) / 0.65
    _assert_matches(_empirical(_params(min_p=0.5)), expected)


def test_temperature_flattens_distribution():
    # T = 2: p_i ∝ p_i^(1/2).
    root = PROBS.sqrt()
    _assert_matches(_empirical(_params(temperature=2.0)), root / root.sum())


def test_greedy_is_argmax_and_ignores_rng():
    sampler = Sampler(_params(temperature=0.0, top_k=2))
    logits = torch.randn(64, 50)
    assert torch.equal(sampler.sample(logits), logits.argmax(-1))


def test_seed_reproducible_and_seeds_differ():
    logits = torch.randn(200, 30)
    a = Sampler(_params(seed=123)).sample(logits)
    b = Sampler(_params(seed=123)).sample(logits)
    c = Sampler(_params(seed=124)).sample(logits)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # A global RNG draw in between does not disturb a request's own generator.
    s1, s2 = Sampler(_params(seed=7)), Sampler(_params(seed=7))
    first = [int(s1.sample(logits[i])) for i in range(20)]
    second = []
    for i in range(20):
        torch.rand(5)
        second.append(int(s2.sample(logits[i])))
    assert first == second


def test_unseeded_requests_get_a_concrete_seed():
    a, b = resolve_sampling(SamplingParams()), resolve_sampling(SamplingParams())
    assert isinstance(a.seed, int) and a.seed != b.seed


def test_processing_equals_transformers_processors():
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(3)
    logits = torch.randn(4, 97) * 3
    context = torch.tensor([5, 9, 9, 40, 96])
    for t, k, p, mp, rp in [(0.7, 20, 0.8, 0.0, 1.0), (1.3, 0, 0.9, 0.05, 1.2), (0.5, 5, 1.0, 0.1, 0.8)]:
        params = _params(temperature=t, top_k=k, top_p=p, min_p=mp, repetition_penalty=rp)
        ours = filter_logits(apply_penalties(logits, context, torch.empty(0, dtype=torch.long), params), params)
        ref = logits.clone()
        ids = context.expand(4, -1)
        ref = RepetitionPenaltyLogitsProcessor(rp)(ids, ref)
        ref = TemperatureLogitsWarper(t)(ids, ref)
        if k:
            ref = TopKLogitsWarper(k)(ids, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(ids, ref)
        if mp:
            ref = MinPLogitsWarper(mp)(ids, ref)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref)), (t, k, p, mp, rp)
        finite = ~torch.isinf(ref)
        torch.testing.assert_close(ours[finite], ref[finite], rtol=1e-6, atol=1e-6)


def test_presence_penalty_subtracts_once_per_generated_token():
    params = _params(presence_penalty=1.5)
    logits = torch.zeros(10)
    out = apply_penalties(logits, torch.tensor([1, 2]), torch.tensor([3, 3, 7]), params)
    expected = torch.zeros(10)
    expected[3] = expected[7] = -1.5
    assert torch.equal(out, expected)


def test_layering_generation_config_then_engine_then_request(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_token_id": [2, 0]})
    )
    defaults = load_generation_defaults(tmp_path)  # (its eos ids are the tokenizer's: test_processing_tokenizer)
    r = resolve_sampling(defaults, SamplingParams(top_k=5, seed=1), SamplingParams(temperature=0.0, stop=("x",)))
    assert (r.temperature, r.top_k, r.top_p, r.seed, r.stop) == (0.0, 5, 0.8, 1, ("x",))
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert resolve_sampling(load_generation_defaults(tmp_path)).greedy


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("temperature", -0.1, "temperature"),
        ("temperature", float("nan"), "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -1, "top_k"),
        ("min_p", 1.2, "min_p"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("presence_penalty", 3.0, "presence_penalty"),
        ("max_new_tokens", 0, "max_new_tokens"),
        ("seed", -3, "seed"),
        ("stop", ("",), "stop"),
    ],
)
def test_out_of_range_values_name_the_field(field, value, fragment):
    with pytest.raises(ValueError, match=fragment):
        validate_sampling(SamplingParams(**{field: value}))


def test_engine_sampling_reproducible_under_seed():
    from orin_vlm_node.engine import Engine, EngineConfig, Request, Turn
    from support.checkpoints import cached_tiny_checkpoint

    torch.set_num_threads(1)
    engine = Engine(
        EngineConfig(
            model_path=str(cached_tiny_checkpoint(layers=1, tie=False, deepstack=(0,), seed=11)),
            page_size=4,
        )
    )

    def run(seed: int) -> tuple[int, ...]:
        sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=seed, max_new_tokens=16)
        final = list(engine.generate(Request(Turn("Tell me a story."), sampling)))[-1]
        assert final.finish_reason in ("stop", "length"), final.error
        return final.token_ids

    first = run(42)
    assert run(42) == first
    assert run(43) != first
    engine.reconfigure(use_paged_attention=False)  # another KV layout
    assert run(42) == first
