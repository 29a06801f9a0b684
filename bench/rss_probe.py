"""Peak resident memory of the engine alone: a fresh process loads the engine, answers one image
prompt, and prints its peak RSS (VmHWM) as JSON on stdout.

Why a separate process: the benchmark process also holds transformers models and other engines, so
its own peak says nothing about what a robot needs for the node's engine.

Usage: ``python -m bench.rss_probe MODEL_DIR HEIGHT WIDTH MAX_NEW_TOKENS DTYPE``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def main() -> int:
    import numpy as np

    from orin_vlm_node.engine import Engine
    from orin_vlm_node.engine.config import EngineConfig
    from orin_vlm_node.engine.events import Finished, Request, SamplingParams, Turn

    model_dir, h, w, n, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    after_import = vm_kib("VmRSS")
    engine = Engine(EngineConfig(model_path=model_dir, device="cpu", dtype=dtype, max_batch=1))
    after_load = vm_kib("VmRSS")
    image = np.random.default_rng(0).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    req = Request(
        turn=Turn(text="Describe this image.", images=(image,)),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=n),
    )
    fin = [e for e in engine.generate(req) if isinstance(e, Finished)][0]
    print(
        json.dumps(
            {
                "rss_after_import_mb": after_import / 1024,
                "rss_after_load_mb": after_load / 1024,
                "peak_rss_mb": vm_kib("VmHWM") / 1024,
                "finish_reason": fin.finish_reason,
                "kv": engine.describe().get("kv_cache", {}),
            }
        )
    )
    return 0 if fin.finish_reason != "error" else 1


if __name__ == "__main__":
    sys.exit(main())
