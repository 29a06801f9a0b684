"""The CPU GEMM kernels (``kernels/cpu_gemm.cpp``) against torch math: few rows (a decode step) and many
rows (a prefill), float and quantized weights (against the torch path of ``weights.quant``, the reference of
the stored formats), their invariance to the row count, and how the library is built, cached and refused."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from orin_vlm_node.cpu import CpuKernelUnavailable, load_cpu_gemm
from orin_vlm_node.cpu.build import FLAGS, build_library, find_compiler
from orin_vlm_node.cuda.sources import find_kernel_sources
from orin_vlm_node.weights.quant import QuantizedLinear, WeightQuant

KERNELS = find_kernel_sources().directory


@pytest.fixture(scope="module")
def gemm(cpu_kernel_cache):
    return load_cpu_gemm(cache_dir=cpu_kernel_cache)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# K: below one vector, a multiple of 8, with a tail; N: below every tile, not a multiple of 120, threaded
@pytest.mark.parametrize("n,k", [(5, 3), (37, 64), (130, 1027), (1210, 1000)])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_every_row_count_computes_f_linear(gemm, threads, n, k, num_threads):
    threads(num_threads)
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    for m in range(1, gemm.max_rows + 1):
        x = torch.randn(m, k, generator=gen)
        out = gemm.few_rows(x, w)
        assert out.shape == (m, n) and out.is_contiguous()
        torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k", [(5, 3), (130, 1027), (1210, 1000)])
def test_bf16_weights_and_activations_compute_the_fp32_product_of_their_values(gemm, n, k):
    """bf16 in, fp32 sums (exact widening), one rounding to bf16 out: what torch's bf16 GEMM does."""
    gen = torch.Generator().manual_seed(n)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    for m in range(1, gemm.max_rows + 1):
        x = torch.randn(m, k, generator=gen).bfloat16()
        out = gemm.few_rows(x, w)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        want = F.linear(x.float(), w.float())
        torch.testing.assert_close(out.float(), want.bfloat16().float(), rtol=8e-3, atol=1e-5)
        torch.testing.assert_close(out, F.linear(x, w), rtol=1.6e-2, atol=1e-3)  # torch's own bf16 product


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_bit_identical_alone_and_in_any_batch(gemm, threads, num_threads, dtype):
    """Batched decode must not change a sequence's logits: every row sums in the same order."""
    threads(num_threads)
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(1500, 1001, generator=gen).to(dtype), torch.randn(gemm.max_rows, 1001, generator=gen).to(dtype)
    alone = torch.cat([gemm.few_rows(x[i : i + 1], w) for i in range(gemm.max_rows)])
    for m in range(2, gemm.max_rows + 1):
        assert torch.equal(gemm.few_rows(x[:m], w), alone[:m]), m
        assert torch.equal(gemm.few_rows(x[:m].flip(0), w), alone[:m].flip(0)), m  # another position in the batch


# rows: every group tail (groups of 6), a block of 192 and past it; K: one vector, several panels of 512 with
# a tail; N: below a panel of 16, a partial last panel, threaded chunks
MANY_ROWS = [*range(1, 14), 191, 192, 200]


@pytest.mark.parametrize("n,k", [(5, 3), (37, 64), (130, 1027), (1210, 1000)])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_many_rows_computes_f_linear(gemm, threads, n, k, num_threads):
    threads(num_threads)
    gen = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=gen) * 0.05, torch.randn(max(MANY_ROWS), k, generator=gen)
    for m in MANY_ROWS:
        out = gemm.many_rows(x[:m], w)
        assert out.shape == (m, n) and out.is_contiguous()
        torch.testing.assert_close(out, F.linear(x[:m], w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k", [(37, 64), (1210, 1000)])
def test_many_rows_with_bf16_computes_the_fp32_product_of_the_values(gemm, n, k):
    gen = torch.Generator().manual_seed(n)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    x = torch.randn(200, k, generator=gen).bfloat16()
    for m in (1, 7, 200):
        out = gemm.many_rows(x[:m], w)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        want = F.linear(x[:m].float(), w.float())
        torch.testing.assert_close(out.float(), want.bfloat16().float(), rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_gives_a_row_the_same_bits_whatever_the_rows_around_it_and_the_threads(gemm, threads, dtype):
    """A prompt's rows do not depend on how the prefill was cut (chunks, a prefix-cache hit's suffix)."""
    gen = torch.Generator().manual_seed(4)
    w, x = torch.randn(1210, 1100, generator=gen).to(dtype), torch.randn(200, 1100, generator=gen).to(dtype)
    threads(1)
    alone = torch.cat([gemm.many_rows(x[i : i + 1], w) for i in range(200)])
    threads(2)
    for m in (2, 6, 7, 13, 192, 200):
        assert torch.equal(gemm.many_rows(x[:m], w), alone[:m]), m
        assert torch.equal(gemm.many_rows(x[:m].flip(0), w), alone[:m].flip(0)), m


def _quantized(n: int, k: int, mode: str, group: int, seed: int) -> QuantizedLinear:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return QuantizedLinear.from_weight(w, WeightQuant(mode, group))


def _stored(module: QuantizedLinear):
    """What the kernels take for ``module``: its int8 values (the caller scales the sums), or the module."""
    return module.qweight if module.mode == "int8" else module


def _widened(module: QuantizedLinear) -> torch.Tensor:
    """The fp32 weight the kernel multiplies by: the torch path's widening (int8 before its row scale)."""
    return module.qweight.float() if module.mode == "int8" else module.dequantize(torch.float32)


# int4 groups: the smallest the kernels take, one that K is not a multiple of, the default; odd K (the last
# byte's high nibble is padding), K below one block of 16 or one vector, K whose last group is one block
QUANTIZED = [("int8", 128, 5, 3), ("int8", 128, 130, 1027), ("int4", 16, 37, 64), ("int4", 16, 130, 1027),
             ("int4", 128, 1210, 1000), ("int4", 16, 5, 3), ("int4", 32, 41, 75), ("int4", 64, 9, 15),
             ("int4", 64, 23, 208)]  # fmt: skip


@pytest.mark.parametrize("mode,group,n,k", QUANTIZED)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_quantized_weights_give_the_product_of_the_torch_paths_widened_weight(gemm, threads, mode, group, n, k,
                                                                              num_threads):  # fmt: skip
    threads(num_threads)
    module = _quantized(n, k, mode, group, seed=n + k)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(max(MANY_ROWS), k, generator=gen)
    for kernel, row_counts in (("few_rows", range(1, gemm.max_rows + 1)), ("many_rows", (1, 7, 13, 200))):
        for m in row_counts:
            out = getattr(gemm, kernel)(x[:m], _stored(module))
            assert out.shape == (m, n) and out.dtype == torch.float32
            # fp32 sums in another order: errors in proportion to the sum of the terms' magnitudes
            magnitude = F.linear(x[:m].abs(), _widened(module).abs()).max().item()
            torch.testing.assert_close(out, F.linear(x[:m], _widened(module)), rtol=1e-5, atol=1e-5 * magnitude)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_row_of_quantized_weights_is_bit_identical_alone_and_in_any_batch(gemm, threads, mode):
    threads(2)
    module = _quantized(1500, 1001, mode, 16, seed=9)
    x = torch.randn(gemm.max_rows, 1001, generator=torch.Generator().manual_seed(9))
    alone = torch.cat([gemm.few_rows(x[i : i + 1], _stored(module)) for i in range(gemm.max_rows)])
    for m in range(2, gemm.max_rows + 1):
        assert torch.equal(gemm.few_rows(x[:m], _stored(module)), alone[:m]), m


def test_int4_factors_of_every_kind_widen_exactly(gemm):
    """Zero scales (a constant group), zero and negative offsets, subnormal fp16 factors (tiny weights)."""
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(6)) * 0.05
    w[0] = 0.0
    w[1] = 0.5
    w[2] *= 1e-4  # scale and offset below fp16's normal range
    w[3, :32] = -2.0
    module = QuantizedLinear.from_weight(w, WeightQuant("int4", 16))
    assert (module.scales == 0).any() and (module.scales[2].abs() < 2**-14).all()
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(7))
    for kernel in (gemm.few_rows, gemm.many_rows):
        torch.testing.assert_close(
            kernel(x, module), F.linear(x, module.dequantize(torch.float32)), rtol=1e-6, atol=1e-6
        )


def test_bf16_activations_with_int4_weights_compute_in_fp32(gemm):
    module = _quantized(64, 256, "int4", 32, seed=3)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = gemm.few_rows(x, module)
    assert out.dtype == torch.bfloat16
    want = F.linear(x.float(), module.dequantize(torch.float32))
    torch.testing.assert_close(out.float(), want.bfloat16().float(), rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("kernel", ["few_rows", "many_rows"])
def test_int4_weights_the_kernel_cannot_read_are_refused_with_the_reason(gemm, kernel):
    x = torch.randn(2, 64)
    for group in (4, 8):
        with pytest.raises(ValueError, match=f"in groups of a power of two >= 16: 64 inputs in groups of {group}"):
            getattr(gemm, kernel)(x, _quantized(16, 64, "int4", group, seed=1))
    module = _quantized(16, 64, "int4", 16, seed=1)
    module.scales = module.scales.t().contiguous().t()  # same values, columns apart
    with pytest.raises(ValueError, match=r"scales is torch.float16 \(16, 4\), not contiguous torch.float16"):
        getattr(gemm, kernel)(x, module)
    with pytest.raises(ValueError, match=r"the weight takes \(m, 64\) rows, got \(2, 48\)"):
        getattr(gemm, kernel)(torch.randn(2, 48), _quantized(16, 64, "int4", 16, seed=1))


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc/self/maps (Linux)")
def test_the_library_runs_on_torchs_openmp_runtime_not_a_second_one(gemm, threads):
    """Its parallel loop must share torch's worker threads: a second runtime's threads would compete with
    torch's, which spin after every torch op (the reason the kernel is built with -fopenmp)."""
    threads(2)
    gemm.few_rows(torch.randn(1, 1024), torch.randn(1200, 1024))  # threaded: the runtime is in use
    mapped = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in mapped if "/libgomp" in line or "/libomp" in line or "/libiomp" in line}
    assert len(runtimes) == 1, runtimes


def test_a_call_from_another_thread_splits_and_computes_the_same(gemm, threads):
    """The engine multiplies on its generation thread, not the one that loaded the library."""
    threads(2)
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(1210, 1000, generator=gen) * 0.05, torch.randn(3, 1000, generator=gen)
    results = []
    worker = threading.Thread(target=lambda: results.append(gemm.few_rows(x, w)))
    worker.start()
    worker.join()
    assert torch.equal(results[0], gemm.few_rows(x, w))
    torch.testing.assert_close(results[0], F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_a_non_contiguous_input_is_taken(gemm):
    w, x = torch.randn(40, 24), torch.randn(24, 3)
    torch.testing.assert_close(gemm.few_rows(x.t(), w), F.linear(x.t(), w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "w,reason",
    [
        (torch.randn(16, 8).t(), "take a contiguous fp32/bf16/int8"),
        (torch.randn(8, 16).half(), "take a contiguous fp32/bf16/int8"),
        (torch.randn(8, 15), r"the weight takes \(m, 15\) rows, got \(2, 16\)"),
    ],
    ids=["transposed", "fp16", "other_k"],
)
@pytest.mark.parametrize("kernel", ["few_rows", "many_rows"])
def test_a_weight_the_kernel_cannot_read_raw_is_refused(gemm, w, reason, kernel):
    with pytest.raises(ValueError, match=reason):
        getattr(gemm, kernel)(torch.randn(2, 16), w)


def test_a_bound_weight_is_checked_once_and_read_at_its_current_address(gemm):
    """A projection binds its weight when routed to the kernels; replacing the weight's storage in place
    (``param.data = ...``) must not leave the kernel reading the old memory."""
    gen = torch.Generator().manual_seed(9)
    w, x = torch.nn.Parameter(torch.randn(24, 16, generator=gen)), torch.randn(3, 16, generator=gen)
    bound = gemm.bind(w)
    torch.testing.assert_close(bound.few_rows(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    w.data = torch.randn(24, 16, generator=gen)
    torch.testing.assert_close(bound.few_rows(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bound.many_rows(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="take a contiguous fp32/bf16/int8"):
        gemm.bind(torch.randn(16, 24).t())


@pytest.mark.parametrize(
    "kernel,rows,accepted", [("few_rows", 0, "1..8"), ("few_rows", 9, "1..8"), ("many_rows", 0, "1 or more")]
)
def test_row_counts_outside_the_kernel_are_refused(gemm, kernel, rows, accepted):
    with pytest.raises(ValueError, match=f"takes {accepted} rows, got {rows}"):
        getattr(gemm, kernel)(torch.randn(rows, 16), torch.randn(8, 16))


def test_the_library_is_compiled_once_and_then_taken_from_the_cache(tmp_path):
    """The next process finds the entry too (the key must not name the compiler driver's temporary files,
    which differ in every process: a node that recompiled at every start)."""
    assert load_cpu_gemm(cache_dir=str(tmp_path)).origin.startswith("compiled in")
    assert load_cpu_gemm(cache_dir=str(tmp_path)).origin == "from the cache"
    code = f"from orin_vlm_node.cpu import load_cpu_gemm; print(load_cpu_gemm(cache_dir={str(tmp_path)!r}).origin)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert proc.stdout.strip() == "from the cache", proc.stdout + proc.stderr
    [entry] = tmp_path.glob("cpu_gemm-*.so.cache")
    entry.write_bytes(entry.read_bytes()[:-100])  # a write cut short
    assert load_cpu_gemm(cache_dir=str(tmp_path)).origin.startswith("compiled in")


def test_an_edited_source_is_rebuilt(tmp_path, gemm, cpu_kernel_cache):
    kernels = shutil.copytree(KERNELS, tmp_path / "kernels")
    shutil.copytree(cpu_kernel_cache, tmp_path / "cache")  # the session's entry for the unedited source
    assert load_cpu_gemm(str(kernels), str(tmp_path / "cache")).origin == "from the cache"
    source = kernels / "cpu_gemm.cpp"
    source.write_text(source.read_text() + "\n// edited\n")
    assert load_cpu_gemm(str(kernels), str(tmp_path / "cache")).origin.startswith("compiled in")
    assert len(list((tmp_path / "cache").glob("cpu_gemm-*.so.cache"))) == 2


# the weight of every panel row scaled, the nibbles of a byte swapped (as the panels widen them, as the few-rows
# tile does), the activations not reordered to match, the scale of a group as its offset, a group's sum of the
# activations (which its offset multiplies) missing the odd k
WRONG = [
    ("few_rows", "torch.float32", "fma8(wv[r], xv, acc[m][r])", "fma8(wv[r] * 1.01f, xv, acc[m][r])"),
    ("many_rows", "torch.float32", "acc[m][1] = fma8(w1, b, acc[m][1])", "acc[m][1] = fma8(w1 * 1.01f, b, acc[m][1])"),
    ("many_rows", "int4 (group 32)", "shifts = {0, 4, 8, 12,", "shifts = {4, 0, 8, 12,"),
    (
        "few_rows",
        "int4 (group 32)",
        "even = __builtin_convertvector(v & 15, v8)",
        "even = __builtin_convertvector(v >> 4, v8)",
    ),
    ("few_rows", "int4 (group 32)", "row[j + t] = from[j + 2 * t];", "row[j + t] = from[j + t];"),
    ("few_rows", "int4 (group 32)", "half_to_float(offsets[(size_t)n0", "half_to_float(scales[(size_t)n0"),
    ("few_rows", "int4 (group 32)", "load8(row + j) + load8(row + j + 8);", "load8(row + j) + load8(row + j);"),
]


@pytest.fixture(scope="module")
def wrong_kernels(tmp_path_factory) -> list[Path]:
    """A kernel directory per WRONG edit, each with its library already in the directory's own cache (the
    compiles run side by side: one compiler process each)."""
    root = tmp_path_factory.mktemp("wrong_kernels")
    folders = []
    for i, (_, _, line, wrong) in enumerate(WRONG):
        kernels = shutil.copytree(KERNELS, root / str(i) / "kernels")
        source = kernels / "cpu_gemm.cpp"
        text = source.read_text()
        assert text.count(line) == 1
        source.write_text(text.replace(line, wrong))
        folders.append(kernels)
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda kernels: build_library(kernels / "cpu_gemm.cpp", kernels.parent / "cache"), folders))
    return folders


@pytest.mark.parametrize("case", range(len(WRONG)), ids=[f"{i}-{k}-{w}" for i, (k, w, _, _) in enumerate(WRONG)])
def test_a_kernel_that_computes_wrong_is_refused_by_the_probe(wrong_kernels, case):
    kernel, weights, _, _ = WRONG[case]
    kernels = wrong_kernels[case]
    with pytest.raises(
        CpuKernelUnavailable, match=f"{kernel} disagrees with F.linear for 1 rows of {re.escape(weights)}"
    ):
        load_cpu_gemm(str(kernels), str(kernels.parent / "cache"))


def test_no_compiler_or_a_compile_error_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(CpuKernelUnavailable, match="is not an executable"):
        load_cpu_gemm(cache_dir=str(tmp_path / "cache"))
    monkeypatch.delenv("CXX")
    kernels = shutil.copytree(KERNELS, tmp_path / "kernels")
    (kernels / "cpu_gemm.cpp").write_text("this is not C++\n")
    with pytest.raises(CpuKernelUnavailable, match="could not compile cpu_gemm.cpp") as info:
        load_cpu_gemm(str(kernels), str(tmp_path / "cache"))
    assert "error" in str(info.value)  # the compiler's own message


def test_kernel_sources_without_the_cpu_kernel_say_so(tmp_path):
    kernels = shutil.copytree(KERNELS, tmp_path / "kernels")
    (kernels / "cpu_gemm.cpp").unlink()
    with pytest.raises(CpuKernelUnavailable, match="lack cpu_gemm.cpp"):
        load_cpu_gemm(str(kernels), str(tmp_path / "cache"))
    with pytest.raises(CpuKernelUnavailable, match="does not exist"):
        load_cpu_gemm(str(tmp_path / "nowhere"), str(tmp_path / "cache"))


def test_an_unwritable_cache_still_gives_a_working_kernel(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    gemm = load_cpu_gemm(cache_dir=str(Path(blocker) / "cache"))  # below a regular file: fails for root too
    w, x = torch.randn(30, 20), torch.randn(2, 20)
    torch.testing.assert_close(gemm.few_rows(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_the_source_compiles_without_a_warning(tmp_path):
    """Strict build of the shipped source with the node's flags (a warning here is a bug on some target)."""
    cmd = [find_compiler(), *FLAGS, "-Wall", "-Wextra", "-Werror", "-o", str(tmp_path / "lib.so")]
    proc = subprocess.run([*cmd, str(KERNELS / "cpu_gemm.cpp")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
