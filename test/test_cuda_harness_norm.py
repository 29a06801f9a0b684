"""The fused RMSNorm kernel (``kernels/rms_norm.cu``) under the CPU CUDA emulator, through ``CudaRmsNorm``
(the GPU path's launch code), against the text decoder's torch RMSNorm: plain rows, the q and k heads of a
fused projection normalised in place with their two weights, and a whole model answering with it."""

from __future__ import annotations

import pytest
import torch

from orin_vlm_node.cuda import launch as L
from orin_vlm_node.cuda.norm import CudaRmsNorm
from orin_vlm_node.model.text import RMSNorm, attach_norm_kernel, rms_norm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The kernel sums the squares in another order than torch's mean and its rsqrt may round otherwise: the
# scale can differ in its last fp32 bits, which moves a half-precision result by one unit in its last place
# only rarely.
TOL = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}


def _norm(dim: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=torch.Generator().manual_seed(seed)))
    return norm.to(dtype)


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    rtol, atol = TOL[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    if want.dtype != torch.float32:  # rounded to half precision: bit for bit but for rare last-place roundings
        assert (got == want).float().mean() >= 0.99


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [32, 128, 200, 2048])
def test_rms_norm_kernel_matches_the_torch_norm_on_rows(harness, dtype, dim):
    norm = _norm(dim, dtype, seed=dim)
    x = (3 * torch.randn(5, dim, generator=torch.Generator().manual_seed(1))).to(dtype)
    want = rms_norm(norm, x)  # torch ops: no kernel attached
    norm.kernel = CudaRmsNorm(harness)
    _check(rms_norm(norm, x), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_q_and_k_heads_are_normalised_in_place_of_the_projection_with_their_own_weights(harness, dtype):
    tokens, nq, nkv, hd = 3, 4, 2, 64
    q_norm, k_norm = _norm(hd, dtype, seed=1), _norm(hd, dtype, seed=2)
    heads = torch.randn(tokens, nq + 2 * nkv, hd, generator=torch.Generator().manual_seed(3)).to(dtype)
    qk = heads[:, : nq + nkv]  # the q and k heads of each token, v heads left out: not contiguous
    weight = torch.cat((q_norm.weight.expand(nq, -1), k_norm.weight.expand(nkv, -1)))
    want = weight * q_norm.normalize(qk)
    got = CudaRmsNorm(harness)(qk, q_norm.weight, k_norm.weight, nq, q_norm.eps)
    _check(got, want)


def test_rms_norm_refuses_rows_it_cannot_take(harness):
    norm = CudaRmsNorm(harness)
    w = torch.ones(8)
    with pytest.raises(ValueError, match=r"\(L, H, D\)"):
        norm(torch.ones(2, 8), w, w, 1, 1e-6)
    with pytest.raises(ValueError, match="does not fit"):
        norm(torch.ones(2, 1, 8), torch.ones(8, dtype=torch.float16), w, 1, 1e-6)
    with pytest.raises(ValueError, match="rows >= 1"):
        L.rms_norm_launch(0, torch.float32)


class _CountingLauncher:
    def __init__(self, inner):
        self.inner = inner
        self.kernels: list[str] = []

    def launch(self, cfg, args):
        self.kernels.append(cfg.kernel)
        return self.inner.launch(cfg, args)


def test_a_model_with_the_norm_kernel_attached_answers_as_with_torch_norms(harness, tmp_path):
    from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn
    from support.checkpoints import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", layers=2, seed=5)
    engine = Engine(EngineConfig(model_path=str(ckpt), device="cpu", dtype="fp32", max_sessions=0))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)

    def answer() -> tuple[int, ...]:
        return tuple(list(engine.generate(Request(Turn("What does the robot see?"), sampling)))[-1].token_ids)

    want = answer()
    launcher = _CountingLauncher(harness)
    layers = engine.model_config.text.num_hidden_layers
    assert attach_norm_kernel(engine.model, CudaRmsNorm(launcher)) == 4 * layers + 1  # 2 + q + k a layer, final
    assert answer() == want
    # Per forward: the input and post-attention norms and one launch for q and k in every layer, the final norm.
    forwards = 12  # the prefill and 11 decode steps
    assert launcher.kernels.count("rms_norm_f32") == forwards * (3 * layers + 1)
    attach_norm_kernel(engine.model, None)
    assert answer() == want
