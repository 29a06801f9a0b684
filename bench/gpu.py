"""GPU: kernel timings, decode with CUDA graphs vs eager, and decode speed against the memory-bandwidth bound.

Only with CUDA (else the section is ``skipped`` with reason "no CUDA device"). Batch-1 decode reads
every decoder weight once per token, so ``weight bytes per token / peak bandwidth`` is the fastest a
token can come; ``bandwidth_fraction = measured tok/s / (peak bandwidth / bytes per token)``. Bytes per
token are the text decoder's parameters (the vision tower does not run in decode; of the embedding
only one row is read, but the tied LM head reads the whole matrix) plus the KV read at that context.
Model: the 2B-shape random checkpoint in fp16 when the shared config is present (what the goal is
stated for), else the default model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from context import BenchContext
from section import SectionResult, skipped
from stats import alternate, paired_ratio
from timing import run_engine
from vs_transformers import greedy

BENCH = Path(__file__).resolve().parent
PROMPT = "Describe what a robot arm does when it picks up the red cube and places it on the table."


def decode_weight_bytes(model) -> int:
    """Bytes one decode step reads from weights: every text-decoder parameter except the embedding
    table, plus the LM head (the embedding matrix itself when tied)."""
    total = 0
    embed = None
    head = None
    for name, p in model.named_parameters():
        if "visual" in name or "vision" in name:
            continue
        if "embed_tokens" in name:
            embed = p
            continue
        if "lm_head" in name:
            head = p
        total += p.numel() * p.element_size()
    if head is None and embed is not None:  # tied: the LM head is the embedding matrix
        total += embed.numel() * embed.element_size()
    return total


def _kernels(res: SectionResult) -> float | None:
    """Run bench/gpu_kernels.py (the CUDA helper's decode-kernel benchmark) and record its figures;
    return the device's peak bandwidth in GB/s (None when it could not be read)."""
    out = subprocess.run(
        [sys.executable, str(BENCH / "gpu_kernels.py")], cwd=BENCH.parent, capture_output=True, text=True, timeout=600
    )
    if out.returncode != 0:
        res.skip_part("kernels", f"bench/gpu_kernels.py exited {out.returncode}: {out.stderr.strip()[-300:]}")
        return None
    report = json.loads(out.stdout)
    res.setup["kernels"] = {k: report.get(k) for k in ("device", "arch", "kernel_build_s", "shape")}
    for row in report["results"]:
        c = row["context"]
        res.add(f"kernels.ctx{c}.paged_us", "us", [row["paged_us"]], "paged decode kernel, shuffled block table")
        res.add(f"kernels.ctx{c}.contiguous_table_us", "us", [row["contiguous_table_us"]],
                "same kernel, identity block table")  # fmt: skip
        res.add(f"kernels.ctx{c}.torch_sdpa_us", "us", [row["torch_sdpa_contiguous_us"]], "torch SDPA, contiguous K/V")
        res.add(f"kernels.ctx{c}.paged_gbs", "GB/s", [row["paged_GBps"]], "paged kernel achieved bandwidth")
    peak = report.get("peak_GBps")
    if peak:
        res.add("peak_bandwidth_gbs", "GB/s", [float(peak)], "2 x memory clock x bus width (driver, via PyCUDA)")
    return float(peak) if peak else None


def run(ctx: BenchContext) -> SectionResult:
    import torch

    if not torch.cuda.is_available():
        return skipped("gpu", "no CUDA device")
    cfg = ctx.config
    res = SectionResult("gpu")
    props = torch.cuda.get_device_properties(0)
    res.setup["device"] = props.name

    peak_gbs = _kernels(res)
    if cfg.big_checkpoint and Path(cfg.big_config_path).is_file():
        model_dir, what = ctx.big_checkpoint(), "2B-shape random checkpoint, fp16"
    else:
        model_dir, what = ctx.default_model()
    res.setup["model"] = what
    from orin_vlm_node.engine import Engine, EngineConfig, Request, Turn

    engines = {
        mode: Engine(EngineConfig(model_path=str(model_dir), device="cuda", dtype="fp16", prefix_caching=False,
                                  use_cuda_graph=(mode == "graphs")))
        for mode in ("graphs", "eager")
    }  # fmt: skip
    res.setup["decode_path"] = {m: e.describe().get("decode_path") for m, e in engines.items()}
    ids = iter(range(10**6))

    def go(mode: str):
        req = Request(
            turn=Turn(text=PROMPT), sampling=greedy(cfg.ros_max_new_tokens * 4), request_id=f"gpu-{next(ids)}"
        )
        return run_engine(engines[mode], req)

    runs = alternate({m: (lambda m=m: go(m)) for m in engines}, repeats=cfg.repeats, warmup=cfg.warmup)
    g, e = runs["graphs"], runs["eager"]
    res.add("graphs.decode_tok_s", "tok/s", [r.decode_tok_s for r in g], "decode with CUDA graphs", mode="graphs")
    res.add("eager.decode_tok_s", "tok/s", [r.decode_tok_s for r in e], "decode without graphs", mode="eager")
    res.add("graphs_speedup", "x", paired_ratio([r.decode_tok_s for r in g], [r.decode_tok_s for r in e]),
            "graphs tok/s / eager tok/s (per pair)")  # fmt: skip
    res.add("graphs.ttft_s", "s", [r.ttft_s for r in g], "TTFT (graphs engine)", mode="graphs")

    engine = engines["graphs"]
    weight_bytes = decode_weight_bytes(engine.model)
    text = engine.model_config.text
    kv_bytes = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * 2 * g[-1].prompt_tokens
    res.setup.update(weight_bytes_per_token=weight_bytes, kv_bytes_per_token=kv_bytes)
    if peak_gbs is None:
        res.skip_part("bandwidth_fraction", "peak bandwidth unknown (bench/gpu_kernels.py did not report it)")
        res.setup["summary"] = f"{props.name}; {what}; batch 1, greedy; peak bandwidth unknown."
        return res
    bound = peak_gbs * 1e9 / (weight_bytes + kv_bytes)
    res.setup["bound_tok_s"] = bound
    res.add("bandwidth_bound_tok_s", "tok/s", [bound], "peak bandwidth / bytes read per decode token")
    res.add("graphs.bandwidth_fraction", "fraction", [r.decode_tok_s / bound for r in g],
            "graphs decode tok/s / bandwidth bound")  # fmt: skip
    res.setup["summary"] = (
        f"{props.name}; {what}; batch 1, greedy; bound = {peak_gbs:.0f} GB/s / "
        f"{(weight_bytes + kv_bytes) / 1e9:.2f} GB per token = {bound:.1f} tok/s."
    )
    return res
