"""The CPU's packed projections: oneDNN's product with the packed weight against ``F.linear`` (torch
math), which models are packed, and an engine whose tokens match the unpacked model's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn
from orin_vlm_node.model import load_model
from orin_vlm_node.model.cpu_linear import FewRowsLinear, PackedLinear, pack_projections, packing_unavailable
from orin_vlm_node.model.quant import weight_bytes
from support.checkpoints import cached_tiny_checkpoint

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(
    packing_unavailable(torch.device("cpu"), torch.float32) is not None,
    reason=f"no oneDNN packing here: {packing_unavailable(torch.device('cpu'), torch.float32)}",
)


@pytest.mark.parametrize("rows", [1, 3, 8, 70])
def test_a_packed_projection_computes_f_linear(rows):
    w, x = torch.randn(96, 130) * 0.05, torch.randn(rows, 130)
    torch.testing.assert_close(PackedLinear(w)(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_only_fp32_on_the_cpu_is_packed():
    assert "bfloat16" in packing_unavailable(torch.device("cpu"), torch.bfloat16)
    assert "not a CPU" in packing_unavailable(torch.device("cuda"), torch.float32)


@pytest.mark.parametrize("tie", [True, False])
def test_packing_replaces_every_decoder_projection_and_an_untied_head_without_growing(tie):
    model = load_model(cached_tiny_checkpoint(tie=tie))
    before = weight_bytes(model)
    what = pack_projections(model, min_weights=0)
    assert weight_bytes(model) == before
    for layer in model.language_model.layers:
        assert all(isinstance(getattr(getattr(layer, s), a), PackedLinear) for s, a in layer.PROJECTIONS)
    assert isinstance(model.lm_head, PackedLinear) != tie and ("tied LM head" in what) == tie
    if tie:  # the head still is the embedding table, multiplied the other way round for a batch
        assert isinstance(model.lm_head, FewRowsLinear)
        assert model.lm_head.weight is model.language_model.embed_tokens.weight


@pytest.mark.parametrize("rows", [1, 2, 4, 8, 9])
def test_a_few_rows_projection_computes_f_linear(rows):
    w, x = torch.randn(300, 64) * 0.05, torch.randn(rows, 64)
    out = FewRowsLinear(w)(x)
    assert out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_a_packed_model_computes_what_the_float_model_computes():
    path = cached_tiny_checkpoint()
    engine = Engine(EngineConfig(model_path=str(path), device="cpu"))  # for its tokenizer and KV cache
    packed, reference = load_model(path), load_model(path)
    pack_projections(packed, min_weights=0)
    ids = engine.tokenizer.encode("Where is the charging station? Count the boxes on the shelf.")
    positions = torch.arange(len(ids)).expand(3, -1)
    logits = []
    for model in (packed, reference):
        seq = engine.cache.new_sequence()
        logits.append(model.forward(torch.tensor(ids), positions, engine.cache.step(seq, len(ids))))
        engine.cache.release(seq)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-5)


def test_small_projections_keep_f_linear_and_the_engine_says_so():
    engine = Engine(EngineConfig(model_path=str(cached_tiny_checkpoint()), device="cpu"))
    layers = len(engine.model.language_model.layers)
    assert engine.describe()["weight_path"].startswith(f"float weights: F.linear ({4 * layers} too small to gain")
    assert not isinstance(engine.model.lm_head, FewRowsLinear)  # a small tied head too: one call is cheaper
    final = list(engine.generate(Request(Turn("Hello."), SamplingParams(temperature=0.0, max_new_tokens=8))))[-1]
    assert final.error is None
