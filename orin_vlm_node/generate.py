"""Command-line generation: ``python -m orin_vlm_node.generate --prompt "..." [--image PATH]...``.

The same engine the ROS node runs, without ROS: useful to check a model directory, a board's speed
or a settings change before launching the node. Text streams to stdout as it is generated; with
``--json`` one JSON object ``{"text", "token_ids", "finish_reason", "metrics", "backend"}`` is printed
instead; ``backend`` says which attention path ran (``kernels: on (...)`` / ``kernels: off (<reason>)``),
the decode path and the KV pool size and why.
Exit status: 0 for every finish reason except ``error``; errors go to stderr with status 1 (bad
input, failed generation) or 2 (bad command line, from argparse).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from .engine import Engine, EngineConfig, EngineError, Finished, Request, SamplingParams, TextDelta, Turn
from .engine.config import DEFAULT_MODEL_DIR
from .engine.sampling import validate_sampling


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m orin_vlm_node.generate", description="Generate text with Qwen3-VL from a prompt and images."
    )
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="HF-format model directory (default: embedded)")
    p.add_argument("--image", action="append", default=[], metavar="PATH", help="image file; repeat for several")
    p.add_argument("--prompt", required=True, help="user text")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N")
    p.add_argument("--temperature", type=float, default=None, metavar="T", help="0 = greedy")
    p.add_argument("--top-p", type=float, default=None, metavar="P")
    p.add_argument("--top-k", type=int, default=None, metavar="K")
    p.add_argument("--min-p", type=float, default=None, metavar="P")
    p.add_argument("--repetition-penalty", type=float, default=None, metavar="R")
    p.add_argument("--presence-penalty", type=float, default=None, metavar="R")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string; repeat for several")
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS (fixed-length answers for timing)")
    p.add_argument("--no-paged", action="store_true", help="contiguous KV cache instead of paged")
    p.add_argument("--page-size", type=int, default=16, metavar="P", help="tokens per KV block (power of two)")
    p.add_argument("--pool-blocks", type=int, default=0, metavar="B", help="KV pool size in blocks (0 = automatic)")
    p.add_argument("--kv-pool-mb", type=float, default=0.0, metavar="MB", help="KV pool size in MB (0 = automatic)")
    p.add_argument("--max-context", type=int, default=4096, metavar="N", help="max tokens of prompt + answer")
    p.add_argument("--no-cuda-graph", action="store_true", help="eager decode step instead of a CUDA graph")
    p.add_argument("--no-cuda-kernels", action="store_true", help="torch attention instead of CUDA kernels")
    p.add_argument("--kernel-dir", default="", metavar="DIR", help="CUDA kernel sources (default: the installed ones)")
    p.add_argument("--kernel-cache-dir", default="", metavar="DIR", help="compiled kernel cache directory")
    p.add_argument(
        "--no-kernel-fallback", action="store_true", help="fail instead of using torch attention when kernels are off"
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr")
    return p


def read_images(paths: Sequence[str]) -> list:
    """BGR uint8 arrays read with OpenCV; ValueError naming the file that cannot be read."""
    import cv2

    images = []
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"image file {path!r} does not exist")
        image = cv2.imread(path, cv2.IMREAD_COLOR)
        if image is None:
            raise ValueError(f"cannot read image file {path!r} (missing, unreadable or not an image)")
        images.append(image)
    return images


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    try:
        images = read_images(args.image)
        sampling = SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            seed=args.seed,
            max_new_tokens=args.max_new_tokens,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos or None,
        )
        validate_sampling(sampling)  # before the model loads: a typo should not cost a load
        config = EngineConfig(
            model_path=args.model,
            device=args.device,
            dtype=args.dtype,
            use_paged_attention=not args.no_paged,
            page_size=args.page_size,
            kv_pool_blocks=args.pool_blocks,
            kv_pool_mb=args.kv_pool_mb,
            max_sessions=0,  # one request, no conversation to keep
            max_context_tokens=args.max_context,
            use_cuda_graph=not args.no_cuda_graph,
            use_cuda_kernels=not args.no_cuda_kernels,
            kernel_dir=args.kernel_dir,
            kernel_cache_dir=args.kernel_cache_dir,
            allow_kernel_fallback=not args.no_kernel_fallback,
        )
        engine = Engine(config)
    except (ValueError, EngineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    described = engine.describe()
    backend = {k: described[k] for k in ("device", "dtype", "kernels", "decode_path", "kv_pool")}
    if described["kernels_degraded"]:
        print(f"warning: {described['kernels']}", file=sys.stderr)
    request = Request(Turn(args.prompt, tuple(images), color="bgr"), sampling=sampling, system_prompt=args.system)
    final: Finished | None = None
    for event in engine.generate(request):
        if isinstance(event, TextDelta):
            if not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
        else:
            final = event
    assert final is not None  # generate always ends with Finished
    if args.json:
        out = {
            "text": final.text,
            "token_ids": list(final.token_ids),
            "finish_reason": final.finish_reason,
            "metrics": final.metrics,
            "backend": backend,
        }
        if final.error:
            out["error"] = final.error
        print(json.dumps(out, ensure_ascii=False))
    elif final.text:
        sys.stdout.write("\n")
    if final.finish_reason == "error":
        print(f"error: {final.error}", file=sys.stderr)
        return 1
    if args.verbose:
        m = final.metrics
        print(
            f"[{final.finish_reason}] {int(m['prompt_tokens'])} prompt tokens, {int(m['generated_tokens'])} generated, "
            f"ttft {m['ttft_s'] * 1000:.0f} ms, decode {m['decode_tokens_per_s']:.1f} tok/s; "
            f"{backend['kernels']}; decode: {backend['decode_path']}; KV pool: {backend['kv_pool']}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
