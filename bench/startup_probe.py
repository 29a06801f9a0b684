"""Startup to ready and GPU memory of the engine alone, in a fresh process, as a robot starts the node.

The parent passes its wall-clock time just before starting this process, so ``ready_s`` counts what an
operator waits for: interpreter and torch import, model load, kernel build (or cache hit), KV pool and
CUDA-graph setup. Then a short text request and a short image request run and the process reports the
GPU memory it uses, its CUDA context included, and torch's peak reservation, and both after each stage
(``memory_stages``: the CUDA context, the ready engine, the text request, the image request), so memory
outside torch's allocator (libraries' code and workspaces loaded on first use) shows where it comes from.
Prints one JSON object.

The device only reports its memory in use by every process (``total - free``); the benchmark process that
starts this one holds a CUDA context and cuBLAS of its own (about 0.9 GB on an H200), so the parent passes
what the device had in use just before the start (OTHERS_MB) and this process's figure is the difference
(``device_used_mb`` keeps the raw reading).

Usage: ``python -m bench.startup_probe MODEL_DIR DTYPE KERNEL_CACHE_DIR MAX_CONTEXT_TOKENS PARENT_START OTHERS_MB``.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    model_dir, dtype, cache_dir, max_context, parent_start, others_mb = sys.argv[1:7]
    import numpy as np
    import torch

    from orin_vlm_node.engine import Engine, EngineConfig, Finished, Request, SamplingParams, Turn

    imported = time.time() - float(parent_start)
    stages: dict[str, dict[str, float]] = {}

    def stage(name: str) -> float:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used = (total - free) / 2**20 - float(others_mb)
        stages[name] = {"used_mb": used, "torch_reserved_mb": torch.cuda.memory_reserved() / 2**20}
        return used

    t0 = time.perf_counter()
    torch.cuda.init()
    stage("cuda_context")
    config = EngineConfig(
        model_path=model_dir,
        device="cuda",
        dtype=dtype,
        kernel_cache_dir=cache_dir,
        max_context_tokens=int(max_context),
        max_sessions=0,
        max_batch=1,
    )
    engine = Engine(config)
    torch.cuda.synchronize()
    ready = time.time() - float(parent_start)
    load = time.perf_counter() - t0
    stage("engine_ready")
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    text = [e for e in engine.generate(Request(Turn("Describe the robot."), sampling)) if isinstance(e, Finished)][0]
    stage("text_request")
    image = np.random.default_rng(0).integers(0, 256, size=(448, 448, 3), dtype=np.uint8)
    request = Request(Turn("Describe this image.", (image,)), sampling)
    final = [e for e in engine.generate(request) if isinstance(e, Finished)][0]
    used = stage("image_request")
    described = engine.describe()
    weights = sum(p.numel() * p.element_size() for p in engine.parts.model.parameters())
    print(
        json.dumps(
            {
                "import_s": imported,
                "engine_s": load,
                "ready_s": ready,
                "finish_reason": final.finish_reason,
                "error": final.error or text.error,
                "used_mb": used,
                "device_used_mb": used + float(others_mb),
                "others_mb": float(others_mb),
                "memory_stages": stages,
                "torch_peak_reserved_mb": torch.cuda.max_memory_reserved() / 2**20,
                "weight_mb": weights / 2**20,
                "kv_pool_mb": described["kv_cache"]["pool_bytes"] / 2**20,
                "kv_context_mb": engine.parts.cache.config.bytes_per_token * int(max_context) / 2**20,
                "kernels": described["kernels"],
                "kv_pool": described["kv_pool"],
                "decode_path": described["decode_path"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
