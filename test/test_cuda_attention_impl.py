"""``CudaPagedAttention`` (the kvcache PagedAttentionImpl of the CUDA layer) driven through a real
``PagedKVCache``, with the kernels running in the CPU harness, against the torch implementation.
Also the shape check and CPU behaviour of ``select_backend``, and ``DecodeGraph`` (with its ``LaunchModes``) on
the CPU."""

from __future__ import annotations

import contextlib

import pytest
import torch
from cuda_harness.harness import RecordingLauncher

from orin_vlm_node.cuda import (
    AttentionShape,
    CudaPagedAttention,
    DecodeGraph,
    KernelsUnavailable,
    LaunchModes,
    select_backend,
)
from orin_vlm_node.cuda import launch as L
from orin_vlm_node.kvcache.attention import TorchPagedAttention
from orin_vlm_node.kvcache.config import KVCacheConfig
from orin_vlm_node.kvcache.paged import PagedKVCache


def _caches(impl, dtype, page, nkv=2, hd=64, max_ctx=96):
    cfg = KVCacheConfig(
        num_layers=2,
        num_kv_heads=nkv,
        head_dim=hd,
        dtype=dtype,
        page_size=page,
        kv_pool_blocks=40,
        max_context_tokens=max_ctx,
        prefix_caching=False,
    )
    return PagedKVCache(cfg, attention_impl=impl), PagedKVCache(cfg, attention_impl=TorchPagedAttention())


@pytest.mark.parametrize(
    ("dtype", "page", "nq"), [(torch.float32, 4, 8), (torch.float16, 16, 4), (torch.bfloat16, 1, 2)]
)
def test_prefill_chunks_and_static_decode_match_torch_impl(harness, dtype, page, nq):
    # min_tokens_per_split small so the decode plan really splits at this capacity.
    impl = CudaPagedAttention(harness, sm_count=16, min_tokens_per_split=16)
    ours, ref = _caches(impl, dtype, page)
    nkv, hd = 2, 64
    atol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}[dtype]
    sa, sb = ours.new_sequence(), ref.new_sequence()
    gen = torch.Generator().manual_seed(5)
    for chunk in (7, 6):  # two prefill chunks: the second attends to the first through the pool
        step_a, step_b = ours.step(sa, chunk), ref.step(sb, chunk)
        for layer in range(2):
            q = torch.randn(chunk, nq, hd, generator=gen).to(dtype)
            k = torch.randn(chunk, nkv, hd, generator=gen).to(dtype)
            v = torch.randn(chunk, nkv, hd, generator=gen).to(dtype)
            torch.testing.assert_close(step_a(layer, q, k, v), step_b(layer, q, k, v), atol=atol, rtol=0)
    buf_a, buf_b = ours.new_static_decode_buffers(), ref.new_static_decode_buffers()
    # The full row and a 32-token context bucket (the static step's widths) both attend correctly.
    widths = (None, 32)
    dec_a = {w: ours.static_decode_attention(buf_a, w) for w in widths}
    dec_b = {w: ref.static_decode_attention(buf_b, w) for w in widths}
    assert impl.decode_plan(buf_a.block_table.shape[1] * page, nq, nkv)[0] > 1
    # Slots 13..24 cross page boundaries; the host half runs before each step, as before a graph replay.
    for i in range(12):
        ours.prepare_static_decode(sa, buf_a)
        ref.prepare_static_decode(sb, buf_b)
        width = widths[i % 2]
        for layer in range(2):
            q = torch.randn(1, nq, hd, generator=gen).to(dtype)
            k = torch.randn(1, nkv, hd, generator=gen).to(dtype)
            v = torch.randn(1, nkv, hd, generator=gen).to(dtype)
            out = dec_a[width](layer, q, k, v)
            torch.testing.assert_close(out, dec_b[width](layer, q, k, v), atol=atol, rtol=0)
    assert torch.equal(ours.kv_storage, ref.kv_storage)  # the write kernel placed every token identically


@pytest.mark.parametrize(
    ("dtype", "page", "sm_count", "split"), [(torch.float16, 4, 16, True), (torch.float32, 16, 1, False)]
)
def test_batched_static_decode_is_one_launch_and_matches_torch_impl(harness, dtype, page, sm_count, split):
    """Three sequences of different lengths decode together in buffers of four (one padding row), the
    kernels in the harness against the torch implementation: same outputs row by row, the same K/V stored
    (the write kernel skips the padding row; the torch path redirects it), one decode launch per layer,
    split or not."""
    launcher = RecordingLauncher(harness)
    impl = CudaPagedAttention(launcher, sm_count=sm_count, min_tokens_per_split=16)
    ours, ref = _caches(impl, dtype, page, max_ctx=64)
    nq, nkv, hd = 4, 2, 64
    atol = {torch.float32: 1e-5, torch.float16: 3e-3}[dtype]
    gen = torch.Generator().manual_seed(11)
    lengths = (5, 23, 12)
    pairs = []
    for n in lengths:
        sa, sb = ours.new_sequence(), ref.new_sequence()
        q = torch.randn(n, nq, hd, generator=gen).to(dtype)
        k = torch.randn(n, nkv, hd, generator=gen).to(dtype)
        v = torch.randn(n, nkv, hd, generator=gen).to(dtype)
        ours.step(sa, n)(0, q, k, v)
        ref.step(sb, n)(0, q, k, v)
        pairs.append((sa, sb))
    buf_a, buf_b = ours.new_static_decode_buffers(4), ref.new_static_decode_buffers(4)
    dec_a, dec_b = ours.static_decode_attention(buf_a, 48), ref.static_decode_attention(buf_b, 48)
    assert (impl.decode_plan(48, nq, nkv, batch=4)[0] > 1) == split  # the plan follows bucket width and batch
    for _ in range(10):  # the sequences cross page boundaries
        for row, (sa, sb) in enumerate(pairs):
            ours.prepare_static_decode(sa, buf_a, row)
            ref.prepare_static_decode(sb, buf_b, row)
        buf_a.pad(3)
        buf_b.pad(3)
        q = torch.randn(4, nq, hd, generator=gen).to(dtype)
        k = torch.randn(4, nkv, hd, generator=gen).to(dtype)
        v = torch.randn(4, nkv, hd, generator=gen).to(dtype)
        launcher.kernels.clear()
        out_a, out_b = dec_a(0, q, k, v), dec_b(0, q, k, v)
        torch.testing.assert_close(out_a[:3], out_b[:3], atol=atol, rtol=0)
        # The write, then one decode launch: with splits too (the last split of a group combines them).
        assert [name.split("_")[1] for name in launcher.kernels] == ["kv", "decode"]
    assert torch.equal(ours.kv_storage, ref.kv_storage)  # nothing of the padding row was stored
    assert [ours.length(sa) for sa, _ in pairs] == [n + 10 for n in lengths]


@pytest.mark.parametrize(
    ("dtype", "hd", "nq", "nkv", "problem"),
    [
        (torch.float16, 128, 16, 8, None),
        (torch.bfloat16, 32, 4, 2, None),
        (torch.float32, 256, 16, 1, None),  # group 16: two chunks of 8 query heads
        (torch.float16, 48, 4, 2, "head_dim 48"),
        (torch.float16, 64, 6, 4, "multiple"),
        (torch.int8, 64, 4, 2, "dtype"),
    ],
)
def test_attention_shape_coverage_is_checked_once_with_a_reason(dtype, hd, nq, nkv, problem):
    reason = AttentionShape(dtype, hd, nq, nkv).unsupported()
    assert reason is None if problem is None else problem in reason


SHAPE = AttentionShape(torch.float16, 128, 16, 8)


def test_select_backend_on_cpu_and_when_disabled():
    choice = select_backend("cpu", True, SHAPE)
    assert (choice.kernels, choice.status, choice.attention_impl, choice.degraded) == (
        False,
        "kernels: off (cpu device)",
        None,
        False,
    )
    assert select_backend("cuda", False, SHAPE).status == "kernels: off (disabled by use_cuda_kernels)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU fallback")
def test_select_backend_cuda_without_gpu_reports_off_or_raises():
    choice = select_backend("cuda", True, SHAPE)
    assert not choice.kernels and choice.degraded
    assert choice.status.startswith("kernels: off (CUDA requested but torch sees no GPU")
    with pytest.raises(KernelsUnavailable, match="no GPU"):
        select_backend("cuda", True, SHAPE, allow_kernel_fallback=False)


def test_decode_graph_is_eager_on_cpu():
    calls = []
    runner = DecodeGraph(lambda: calls.append(1) or torch.ones(2), "cpu", stream=None)
    assert torch.equal(runner.run(), torch.ones(2)) and torch.equal(runner(), torch.ones(2))
    assert len(calls) == 2 and not runner.captured and runner.describe()["eager_reason"] == "cpu device"
    assert runner.eager


class _SwitchRecorder:
    """A runtime's dependent-launch check result and switch, recording what each capture asked for."""

    def __init__(self, status: str):
        self.programmatic_status = status
        self.asked: list[bool] = []

    @contextlib.contextmanager
    def dependent_launches(self, on: bool):
        self.asked.append(on)
        yield


@pytest.mark.parametrize(
    ("status", "setting", "modes"),
    [
        ("on", "auto", (True, False)),  # both captured, the faster replay kept
        ("on", "on", (True,)),
        ("on", "off", (False,)),
        ("off (sm_87: it needs sm_90 or later)", "auto", (False,)),  # an Orin: plain whatever the setting
        ("off (the driver has no cuLaunchKernelEx)", "on", (False,)),
    ],
)
def test_launch_modes_capture_dependent_launches_only_where_the_runtime_runs_them(status, setting, modes):
    launches = LaunchModes(_SwitchRecorder(status), setting)
    assert launches.modes() == modes
    for dependent in modes:
        with launches.during(dependent):
            pass
    assert launches.runtime.asked == list(modes)


@pytest.mark.parametrize(
    ("sm_count", "capacity", "batch", "plan"),
    [
        (132, 1024, 1, (32, 32)),  # H200, 8 kv heads: the fastest splits measured at 1k, 4k, 16k of context
        (132, 4096, 1, (64, 64)),
        (132, 16384, 1, (128, 128)),
        (16, 4096, 1, (16, 256)),  # an Orin's 16 SMs: 8 blocks per SM take longer splits
        (132, 4096, 8, (16, 256)),  # a batch fills the SMs with fewer splits
        (16, 16, 1, (1, 16)),  # a row of one warp step is never split
    ],
)
def test_decode_split_plan_keeps_blocks_in_flight_and_splits_grow_with_the_context(sm_count, capacity, batch, plan):
    splits, tokens = L.choose_decode_splits(capacity, batch, 8, sm_count)
    assert (splits, tokens) == plan
    assert tokens % 16 == 0 or splits == 1
    assert (splits - 1) * tokens < capacity <= splits * tokens  # every split holds tokens, all are covered
