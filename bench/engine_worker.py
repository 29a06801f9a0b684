"""The engine alone in its own process, answering requests sent as JSON lines on stdin.

Why: the ROS comparison needs "the same engine without ROS" under the same conditions as the node, a
process of its own. Run inside the benchmark process, the engine would share the interpreter (and its
GIL) with the ROS client's spinning executor thread, which would slow the wrong side.

Protocol: argv = MODEL_DIR DTYPE; each stdin line ``{"text", "image_hw": [h, w] | null, "seed",
"max_new_tokens"}``; each answer one stdout line ``{"first_token_s", "last_token_s", "texts",
"metrics"}`` (times from the ``generate()`` call to the first/last non-empty text delta); ``"ready"``
is printed once the engine is loaded. Engine settings are bench's CPU settings (make_engine).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> int:
    from bench.context import BenchContext
    from bench.vs_transformers import greedy, make_engine
    from orin_vlm_node.engine import Request, TextDelta, Turn

    model_dir, dtype = sys.argv[1], sys.argv[2]
    engine = make_engine(Path(model_dir), dtype, prefix_caching=False)
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        images = (BenchContext.image(*job["image_hw"], seed=job["seed"]),) if job.get("image_hw") else ()
        req = Request(turn=Turn(text=job["text"], images=images), sampling=greedy(int(job["max_new_tokens"])))
        times: list[float] = []
        texts: list[str] = []
        metrics: dict = {}
        t0 = time.perf_counter()
        for ev in engine.generate(req):
            if isinstance(ev, TextDelta):
                if ev.text:
                    times.append(time.perf_counter() - t0)
                    texts.append(ev.text)
            else:
                metrics = dict(ev.metrics)
                if ev.finish_reason == "error":
                    metrics["error"] = ev.error
        out = {
            "first_token_s": times[0] if times else None,
            "last_token_s": times[-1] if times else None,
            "texts": texts,
            "metrics": metrics,
        }
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
