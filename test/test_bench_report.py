"""The benchmark bookkeeping: statistics, alternation order, schema validation, goal evaluation and the
Markdown report. No engine needed; results are built here from known samples."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from bench.goals import GOALS, PAGED_GOAL_KEYS, evaluate_goals
from bench.report import render
from bench.schema import SECTIONS, SchemaError, validate_result
from bench.section import SectionResult, skipped
from bench.stats import Figure, alternate, paired_ratio


def test_figure_reduces_samples_to_min_median_max():
    d = Figure("s", [3.0, 1.0, 2.0, 10.0]).as_dict()
    assert (d["min"], d["median"], d["max"], d["n"]) == (1.0, 2.5, 10.0, 4)
    with pytest.raises(ValueError, match="no samples"):
        Figure("s", []).as_dict()


def test_paired_ratio_is_per_pair_and_checks_lengths():
    assert paired_ratio([2.0, 9.0], [1.0, 3.0]) == [2.0, 3.0]
    with pytest.raises(ValueError, match="differ in length"):
        paired_ratio([1.0], [1.0, 2.0])


def test_alternate_interleaves_and_flips_the_starting_side():
    order: list[str] = []
    out = alternate({"a": lambda: order.append("a") or len(order), "b": lambda: order.append("b") or len(order)},
                    repeats=3, warmup=1)  # fmt: skip
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up round, then a-b, b-a, a-b
    assert out == {"a": [3, 6, 7], "b": [4, 5, 8]}


def _result(**section_figures) -> dict:
    """A schema-valid result whose ok sections hold the given {key: samples} figures."""
    sections = {}
    for name in SECTIONS:
        figs = section_figures.get(name)
        if figs is None:
            sec = skipped(name, "not selected (--sections)")
        else:
            sec = SectionResult(name)
            for key, samples in figs.items():
                sec.add(key, "x", samples)
        sections[name] = sec.as_dict()
    result = {
        "schema_version": 1,
        "mode": "test",
        "created": "2026-01-01T00:00:00+00:00",
        "duration_s": 1.0,
        "machine": {k: "x" for k in ("cpu_model", "python", "torch", "transformers", "git_commit")}
        | {"cores": 2, "ram_gib": 24.0, "cuda_device": None},
        "config": {},
        "sections": sections,
    }
    result["goals"] = evaluate_goals(result)
    return result


def test_valid_result_passes_and_broken_ones_name_the_problem():
    good = _result(vs_transformers={"default.text.decode_ratio": [1.0, 2.0]})
    validate_result(good)

    bad = copy.deepcopy(good)
    bad["sections"]["vs_transformers"]["figures"]["default.text.decode_ratio"]["max"] = 1.5
    with pytest.raises(SchemaError, match="inconsistent"):
        validate_result(bad)

    bad = copy.deepcopy(good)
    bad["sections"]["gpu"]["reason"] = ""
    with pytest.raises(SchemaError, match="gpu.reason"):
        validate_result(bad)

    bad = copy.deepcopy(good)
    del bad["sections"]["ros"]
    with pytest.raises(SchemaError, match="sections.ros: missing"):
        validate_result(bad)

    bad = copy.deepcopy(good)
    bad["sections"]["memory"] = SectionResult("memory").as_dict()  # ok but empty
    with pytest.raises(SchemaError, match="at least one figure"):
        validate_result(bad)


def test_goals_take_the_worst_checkpoint_and_respect_direction():
    result = _result(
        vs_transformers={
            "default.text.decode_ratio": [2.0, 2.2, 2.4],
            "2b_bf16.text.decode_ratio": [1.2, 1.3, 1.4],
            "default.text.ttft_ratio": [0.5, 0.6, 0.7],
        },
        prefix_cache={"image_system.ttft_cut": [0.9, 0.85, 0.95]},
        batching={"default.batch4.speedup": [1.1, 1.2, 1.3], "2b_fp32.batch4.speedup": [1.8, 1.9, 1.7]},
    )
    by_id = {g["id"]: g for g in evaluate_goals(result)}
    assert by_id["batching_4_cpu"]["status"] == "not_met" and by_id["batching_4_cpu"]["value"] == 1.8  # 2B only
    assert "2b_fp32" in by_id["batching_4_cpu"]["source"]
    assert by_id["cpu_decode_vs_hf"]["status"] == "met"  # the default model's goal reads default.* only
    assert by_id["cpu_decode_vs_hf"]["value"] == pytest.approx(2.2)
    assert by_id["cpu_decode_vs_hf_2b"]["status"] == "met" and by_id["cpu_decode_vs_hf_2b"]["value"] == 1.3
    assert "2b_bf16" in by_id["cpu_decode_vs_hf_2b"]["source"]
    assert by_id["cpu_ttft_vs_hf"]["status"] == "met"
    assert by_id["prefix_cache_ttft_cut"]["status"] == "met"
    assert by_id["gpu_graphs_bound"]["status"] == "not_measured"
    assert "not selected" in by_id["gpu_graphs_bound"]["source"]
    assert by_id["paged_overhead"]["status"] == "not_measured"
    assert len(by_id) == len(GOALS)


def test_paged_goal_takes_the_worst_of_4k_16k_fresh_and_churned():
    figures = {key: [0.01, 0.02, 0.03] for key in PAGED_GOAL_KEYS}
    figures["ctx16384.page16_churn.decode_overhead"] = [0.06, 0.07, 0.08]
    by_id = {g["id"]: g for g in evaluate_goals(_result(paged_vs_contiguous=figures))}
    goal = by_id["paged_overhead"]
    assert goal["status"] == "not_met" and goal["value"] == pytest.approx(0.07)
    assert "ctx16384.page16_churn" in goal["source"]
    del figures["ctx4096.page16_churn.decode_overhead"]
    by_id = {g["id"]: g for g in evaluate_goals(_result(paged_vs_contiguous=figures))}
    assert by_id["paged_overhead"]["status"] == "not_measured"
    assert "ctx4096.page16_churn" in by_id["paged_overhead"]["source"]


def test_gpu_goals_take_the_worst_dtype_and_name_the_device():
    result = _result(
        gpu={
            "decode.fp16.graphs.bound_fraction": [0.81, 0.82, 0.80],
            "decode.bf16.graphs.bound_fraction": [0.66, 0.68, 0.67],
            "decode.fp16.graphs_vs_hf": [2.0, 2.1, 1.9],
            "kernels.ctx4096.page16.overhead": [0.03, 0.02, 0.04],
            "kernels.ctx4096.page64.overhead": [0.01, 0.0, 0.02],
            "startup.warm_s": [7.5],
            "memory.default_model.used_mb": [812.0],
            "memory.2b_fp16.used_vs_limit": [1.08],
            "batching.fp16.batch4.speedup": [3.4, 3.5, 3.3],
            "batching.fp16.batch4.member_latency_vs_one": [1.2, 1.6, 1.1],
        }
    )
    result["sections"]["gpu"]["setup"]["device"] = "NVIDIA H100 80GB HBM3"
    by_id = {g["id"]: g for g in evaluate_goals(result)}
    bound = by_id["gpu_graphs_bound"]
    assert bound["status"] == "not_met" and bound["value"] == pytest.approx(0.67)
    assert "decode.bf16.graphs.bound_fraction" in bound["source"] and "NVIDIA H100" in bound["source"]
    assert by_id["gpu_graphs_vs_hf"]["status"] == "met"
    assert by_id["gpu_paged_kernel_4k"]["value"] == pytest.approx(0.03)  # page 16 is the stated goal
    assert by_id["gpu_warm_startup"]["status"] == "met"
    assert by_id["gpu_memory_default_model"]["status"] == "met"
    assert by_id["gpu_memory_2b"]["status"] == "not_met"
    assert by_id["batching_4_gpu"]["status"] == "met" and by_id["batching_4_gpu"]["value"] == pytest.approx(3.4)
    assert by_id["batching_4_gpu_latency"]["status"] == "met"  # the median, 1.2


def test_report_marks_goals_and_lists_figures():
    result = _result(
        vs_transformers={"default.text.decode_ratio": [1.0, 1.1, 1.2]},
        paged_vs_contiguous={key: [0.01, 0.02, 0.03] for key in PAGED_GOAL_KEYS},
    )
    text = render(result)
    assert "| CPU decode tok/s >= 1.2x" in text
    assert "**not met**" in text  # decode ratio 1.1 < 1.2
    overhead_row = next(line for line in text.splitlines() if line.startswith("| Paged decode overhead"))
    assert "2.0%" in overhead_row and "| met |" in overhead_row
    assert "`default.text.decode_ratio`" in text
    assert "*skipped*: not selected (--sections)" in text


def test_decode_weight_bytes_counts_the_text_decoder_and_one_lm_head():
    import torch

    from bench.gpu_engines import decode_weight_bytes
    from orin_vlm_node.weights.quant import LM_HEAD_QUANT, QuantizedLinear

    def model(tied: bool, quantized_head: bool = False) -> torch.nn.Module:
        m = torch.nn.Module()
        m.visual = torch.nn.Linear(8, 8)  # never read in decode
        m.language_model = torch.nn.Module()
        m.language_model.embed_tokens = torch.nn.Embedding(100, 16)  # one row read; the tied head reads all
        m.language_model.layer = torch.nn.Linear(16, 16, bias=False)
        if not tied:
            m.lm_head = torch.nn.Linear(16, 100, bias=False)
        if quantized_head:  # int8 (100, 16) + fp16 scales (100,); a tied table stays for the lookups
            m.lm_head = QuantizedLinear.from_weight(m.language_model.embed_tokens.weight, LM_HEAD_QUANT)
        return m

    layer = 16 * 16 * 4
    assert decode_weight_bytes(model(tied=True)) == layer + 100 * 16 * 4
    assert decode_weight_bytes(model(tied=False)) == layer + 100 * 16 * 4  # lm_head instead of the embedding
    for tied in (True, False):
        assert decode_weight_bytes(model(tied, quantized_head=True)) == layer + 100 * 16 + 100 * 2


def test_gpu_section_parts_record_a_failure_and_stop_starting_parts_once_the_budget_is_spent(tmp_path, monkeypatch):
    import types
    from dataclasses import replace

    import bench.gpu
    from bench.config import FULL
    from bench.context import BenchContext

    clock = [0.0]  # the section's own clock, advanced by the parts only (deterministic)
    monkeypatch.setattr(bench.gpu, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    ran: list[str] = []

    def part(name: str, seconds: float = 0.0, fail: bool = False):
        def run() -> None:
            ran.append(name)
            clock[0] += seconds
            if fail:
                raise RuntimeError(f"{name} broke")

        return name, run

    res = SectionResult("gpu")
    ctx = BenchContext(replace(FULL, gpu_budget_s=10.0), tmp_path)
    bench.gpu._run_parts(ctx, res, 0.0, [part("a", 1, fail=True), part("b", 20), part("c"), part("d")])
    assert ran == ["a", "b"]  # a's error did not stop b; after b the budget was spent
    assert res.skipped_parts[0] == {"part": "a", "reason": "error: RuntimeError: a broke"}
    assert [p["part"] for p in res.skipped_parts[1:]] == ["c", "d"]
    assert all(p["reason"] == "time budget of 10 s spent (21 s)" for p in res.skipped_parts[1:])

    late = SectionResult("gpu")  # the setup alone spent the budget: the first part still runs, no other
    ran.clear()
    clock[0] = 0.0
    bench.gpu._run_parts(ctx, late, -30.0, [part("a"), part("b")])
    assert ran == ["a"] and late.skipped_parts == [{"part": "b", "reason": "time budget of 10 s spent (30 s)"}]

    unlimited = SectionResult("gpu")
    ran.clear()
    bench.gpu._run_parts(BenchContext(FULL, tmp_path), unlimited, -1e6, [part("a"), part("b")])
    assert ran == ["a", "b"] and unlimited.skipped_parts == []  # gpu_budget_s 0: no limit


def test_gpu_section_runs_only_the_selected_parts_and_says_why_the_others_are_missing(tmp_path):
    from dataclasses import replace

    import bench.gpu
    from bench.config import FULL, OTHER_PARTS, part_names
    from bench.context import BenchContext

    assert part_names(("fp16", "bf16")) == ["decode.fp16", *OTHER_PARTS, "decode.bf16"]
    chosen = part_names(("fp16", "bf16"), ("kernels", "decode.fp16"))
    assert chosen[:3] == ["kernels", "decode.fp16", "step_profile"] and sorted(chosen) == sorted(
        part_names(("fp16", "bf16"))
    )
    ran: list[str] = []
    parts = [(name, lambda n=name: ran.append(n)) for name in part_names(("fp16", "bf16"))]
    res = SectionResult("gpu")
    bench.gpu._run_parts(BenchContext(replace(FULL, gpu_parts=("kernels", "decode.bf16")), tmp_path), res, 0.0, parts)
    assert ran == ["kernels", "decode.bf16"]
    assert [p["part"] for p in res.skipped_parts] == [
        "decode.fp16",
        *(n for n in OTHER_PARTS if n != "kernels"),
    ]
    assert {p["reason"] for p in res.skipped_parts} == {"not selected (--gpu-parts)"}


def test_bench_refuses_an_unknown_gpu_part():
    import subprocess

    run = subprocess.run([sys.executable, "-m", "bench.run", "--sections", "gpu", "--gpu-parts", "kernels,nope"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "unknown GPU part(s) ['nope']" in run.stderr


def test_gpu_step_profile_sorts_kernels_into_categories():
    from bench.gpu_profile import kernel_category

    assert kernel_category("nvjet_sm90_hsh_128x8_64x12_4x1_v_bz_TNT") == "gemm"
    assert kernel_category("void cublasLt::splitKreduce_kernel<32, 16, int, float>") == "gemm"
    assert kernel_category("gemv_int4_f16_r1") == kernel_category("gemv_float_f16_r8") == "gemm"
    assert kernel_category("paged_decode_attention_f16_d128_g2") == "attention"
    assert kernel_category("paged_kv_write_f16") == "attention"
    assert kernel_category("rms_norm_rope_bf16") == "fused_elementwise"
    assert kernel_category("silu_mul_f16") == "fused_elementwise"
    assert kernel_category("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add>") == (
        "other_elementwise"
    )


def test_gpu_step_profile_counts_overlapping_kernels_once():
    from bench.gpu_profile import busy_us

    assert busy_us([]) == 0.0
    assert busy_us([(0.0, 2.0), (5.0, 6.0)]) == 3.0  # apart: a gap between them
    assert busy_us([(4.0, 9.0), (0.0, 5.0), (1.0, 2.0)]) == 9.0  # overlapping and nested, in any order


def test_the_l2_prefetch_part_empties_the_prefetch_the_kernels_have():
    """The ``l2_prefetch`` part builds kernels from a copy of the sources with ``prefetch_l2`` emptied: the line
    it replaces is the one ``compat.cuh`` has, once, so a change to it shows here, not as a skipped part."""
    from bench.gpu import L2_PREFETCH
    from orin_vlm_node.cuda.sources import find_kernel_sources

    assert (find_kernel_sources().directory / "compat.cuh").read_text().count(L2_PREFETCH) == 1


def test_a_section_whose_process_dies_is_an_error_naming_how_and_one_that_wrote_its_result_is_taken(tmp_path):
    """Each section runs in a process of its own: one killed (for memory, say) before writing its result is
    recorded as an error with the signal, and the run goes on; a result the process wrote is the section's."""
    import bench.run

    out = tmp_path / "section.json"
    killed = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    result = bench.run.section_in_child("memory", killed, out)
    assert result["status"] == "error"
    assert "killed by signal 9" in result["reason"] and "out of memory" in result["reason"]
    failed = bench.run.section_in_child("memory", [sys.executable, "-c", "raise SystemExit(3)"], out)
    assert failed["status"] == "error" and "exit status 3" in failed["reason"]

    res = SectionResult("memory")
    res.add("x", "s", [1.0, 2.0], "a figure")
    write = f"import pathlib, sys; pathlib.Path(sys.argv[1]).write_text({json.dumps(json.dumps(res.as_dict()))})"
    assert bench.run.section_in_child("memory", [sys.executable, "-c", write, str(out)], out) == res.as_dict()


def test_a_checkpoint_an_earlier_sections_process_built_in_the_scratch_directory_is_reused(tmp_path, monkeypatch):
    """Sections share the run's scratch directory, not a process: a later section's context finds the
    checkpoint there instead of building it again; a half-written one (no tokenizer yet) is built again."""
    import support.checkpoints
    from bench.config import FULL
    from bench.context import BenchContext

    built: list[Path] = []

    def build(out: Path, **_: object) -> Path:
        built.append(out)
        out.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text("{}")
        return out

    monkeypatch.setattr(support.checkpoints, "make_tiny_checkpoint", build)
    first = BenchContext(FULL, tmp_path).talkative_checkpoint()
    assert BenchContext(FULL, tmp_path).talkative_checkpoint() == first and built == [first]
    (first / "tokenizer.json").unlink()
    assert BenchContext(FULL, tmp_path).talkative_checkpoint() == first and built == [first, first]
