"""Model load alone in a fresh process: seconds and peak resident memory of ``load_model`` (CPU, one torch
thread), printed as JSON on stdout.

Why a separate process: the peak RSS of the benchmark process says nothing about one load (it holds other
models), and each load must start with nothing of the checkpoint in the process.

Usage: ``python -m bench.load_probe MODEL_DIR DTYPE WEIGHT_QUANT GROUP_SIZE``.
"""

from __future__ import annotations

import json
import sys
import time

from bench.rss_probe import vm_kib


def main() -> int:
    import torch

    from orin_vlm_node.weights import load_model
    from orin_vlm_node.weights.quant import WeightQuant, weight_bytes

    model_dir, dtype, mode, group = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    torch.set_num_threads(1)
    before = vm_kib("VmRSS")
    start = time.perf_counter()
    model = load_model(model_dir, dtype, quant=WeightQuant(mode, group))
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "load_s": seconds,
                "peak_rss_mb": vm_kib("VmHWM") / 1024,
                "rss_before_mb": before / 1024,
                "weight_mb": weight_bytes(model) / 1e6,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
