"""Command-line generation: ``python -m orin_vlm_node.generate --prompt "..." [--image PATH]... [--video PATH...]``.

The same engine the ROS node runs, without ROS: useful to check a model directory, a board's speed
or a settings change before launching the node. Every engine and sampling setting of the schema
(``orin_vlm_node.settings``) is a flag of the same name and default as the node's parameter
(``page_size`` is ``--page-size``, a boolean ``use_cuda_graph`` is ``--use-cuda-graph`` /
``--no-use-cuda-graph``), plus ``--system-prompt``, ``--stop`` and ``--ignore-eos``; ``--json-schema``,
``--regex`` or ``--choice`` constrain the answer to a format (``--json`` then carries its parsed value);
``--video`` sends a video file or frame files as Qwen3-VL's video input.

More in docs/modules.md, ``orin_vlm_node/generate.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence

from . import settings
from .engine import (
    Engine,
    EngineError,
    Finished,
    OutputFormat,
    Request,
    SamplingParams,
    TextDelta,
    Turn,
    Video,
    output_format,
)
from .engine.config import config_from_settings
from .engine.description import backend_summary
from .engine.grounding import detections, grounding_request, parse_labels
from .media_files import read_images, read_video
from .remote.engine import RemoteEngine, remote_config

# The settings a one-shot command uses: the engine's, sampling, and the system prompt (no queue, no
# conversation kept, no camera).
CLI_SETTINGS = tuple(s for s in settings.SETTINGS if s.consumer != "node" or s.name == "system_prompt")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m orin_vlm_node.generate", description="Generate text with Qwen3-VL from a prompt and images."
    )
    p.add_argument("--prompt", help="user text (required unless --detect)")
    p.add_argument("--image", action="append", default=[], metavar="PATH", help="image file; repeat for several")
    p.add_argument(
        "--video",
        action="append",
        nargs="+",
        default=[],
        metavar="PATH",
        help="a video file, or image files that are its frames in order; repeat for several videos",
    )
    p.add_argument(
        "--video-fps",
        dest="video_rate",  # the node's video_fps is its own parameter; this flag is the command's
        type=float,
        default=2.0,
        metavar="RATE",
        help="frames a second: sampled from a video file, or the spacing of frame files (default 2)",
    )
    p.add_argument("--video-times", metavar="SECONDS", help="frame files' times, comma-separated (one --video)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string; repeat for several")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS (fixed-length answers for timing)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", metavar="SCHEMA", help="answer as JSON matching this schema (inline or a file)")
    fmt.add_argument("--regex", metavar="REGEX", help="answer matching this regular expression")
    fmt.add_argument("--choice", action="append", metavar="TEXT", help="answer with one of these; repeat for each")
    fmt.add_argument("--detect", metavar="LABELS", help="find these objects ('red cup, person') in the images: "
                     "their boxes in pixels (--json: 'detections')")  # fmt: skip
    p.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr")
    for s in CLI_SETTINGS:
        unit = f" {s.unit}" if s.unit else ""
        help_text = f"{s.description} (default: {s.default!r}{unit})"
        if s.type is bool:
            p.add_argument(s.flag, action=argparse.BooleanOptionalAction, default=s.default, help=help_text)
        else:
            p.add_argument(s.flag, type=s.type, default=s.default, choices=s.choices or None, help=help_text)
    return p


def cli_output_format(args: argparse.Namespace) -> OutputFormat | None:
    """The output format the flags ask for (a ``--json-schema`` naming a file is read from it); ValueError."""
    if args.json_schema is not None:
        spec = args.json_schema
        if not spec.lstrip().startswith("{") and os.path.isfile(spec):
            with open(spec, encoding="utf-8") as f:
                spec = f.read()
        return output_format("json_schema", spec)
    if args.regex is not None:
        return output_format("regex", args.regex)
    return output_format("choice", args.choice) if args.choice else None


def _engine(values: dict) -> Engine | RemoteEngine:
    """Bounds first, from the schema (a typo should not cost a model load), then the engine's own rules; with
    backend openai the server's engine (no model loaded here)."""
    settings.check(values)
    if values["backend"] == "openai":
        return RemoteEngine(remote_config(values, max_batch=1))
    # One request: no conversation to keep, nothing to batch with.
    return Engine(config_from_settings(values, max_sessions=0, max_batch=1))


def _report(final: Finished, backend: dict, as_json: bool, verbose: bool, found: list | None = None) -> int:
    if as_json:
        out = {
            "text": final.text,
            "token_ids": list(final.token_ids),
            "finish_reason": final.finish_reason,
            "metrics": final.metrics,
            "backend": backend,
        }
        if final.output is not None:
            out["output"] = final.output
        if found is not None:
            out["detections"] = [d.as_dict() for d in found]
        if final.error:
            out["error"] = final.error
        print(json.dumps(out, ensure_ascii=False))
    elif final.text:
        sys.stdout.write("\n")
    if final.finish_reason == "error":
        print(f"error: {final.error}", file=sys.stderr)
        return 1
    if verbose:
        m = final.metrics
        print(
            f"[{final.finish_reason}] {int(m['prompt_tokens'])} prompt tokens, {int(m['generated_tokens'])} generated, "
            f"ttft {m['ttft_s'] * 1000:.0f} ms, decode {m['decode_tokens_per_s']:.1f} tok/s; "
            f"{backend_summary(backend)}",
            file=sys.stderr,
        )
    return 0


REMOTE_KEYS = ("backend", "remote_url", "remote_model", "server_reachable", "model_listed", "server_problem")
BACKEND_KEYS = ("device", "dtype", "checkpoint_weights", "weight_quant", "lm_head", "weight_mb", "weight_path",
                "kernels", "decode_path", "kv_pool")  # fmt: skip


def cli_videos(args: argparse.Namespace) -> tuple[Video, ...]:
    """The videos of the ``--video`` flags, timed by ``--video-fps`` or ``--video-times``; ValueError."""
    times = None
    if args.video_times is not None:
        if len(args.video) != 1:
            raise ValueError("--video-times needs exactly one --video")
        try:
            times = [float(t) for t in args.video_times.split(",")]
        except ValueError:
            raise ValueError(f"--video-times must be comma-separated seconds, got {args.video_times!r}") from None
    return tuple(read_video(paths, args.video_rate, times) for paths in args.video)


def cli_request(args: argparse.Namespace, system_prompt: str | None, images: Sequence) -> Request:
    """The request the flags ask for: the prompt with its output format, or the grounding prompt of
    ``--detect`` (its answer's token probabilities kept for the scores); ValueError."""
    sampling = SamplingParams(stop=tuple(args.stop), ignore_eos=args.ignore_eos or None)
    if args.detect is not None:
        if args.video:
            raise ValueError("--detect finds objects in images; it takes no --video")
        text, fmt = grounding_request(parse_labels(args.detect), len(images))
        return Request(Turn(text, tuple(images), color="bgr"), sampling, system_prompt, output=fmt, token_probs=True)
    turn = Turn(args.prompt, tuple(images), color="bgr", videos=cli_videos(args))
    return Request(turn, sampling, system_prompt, output=cli_output_format(args))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompt is None and args.detect is None:
        parser.error("the following arguments are required: --prompt (or --detect)")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    values = {s.name: getattr(args, s.name) for s in CLI_SETTINGS}
    try:
        images = read_images(args.image)
        request = cli_request(args, values["system_prompt"] or None, images)
        engine = _engine(values)
    except (ValueError, EngineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    described = engine.describe()
    if described.get("kernels_degraded"):
        print(f"warning: {described['kernels']}", file=sys.stderr)
    final: Finished | None = None
    for event in engine.generate(request):
        if isinstance(event, TextDelta):
            if not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
        else:
            final = event
    assert final is not None  # generate always ends with Finished
    found = None
    if args.detect is not None and final.finish_reason != "error":
        try:
            sizes = [image.shape[:2] for image in images]
            found = detections(final.text, final.token_probs or (), final.token_spans or (), sizes)
        except ValueError as exc:  # never a partial answer: the objects of an answer that does not parse
            final = dataclasses.replace(final, finish_reason="error", error=str(exc))
    described = engine.describe()  # after the answer: a server's check has had time to run
    engine.close()
    return _report(
        final,
        {k: described[k] for k in (*BACKEND_KEYS, *REMOTE_KEYS) if k in described},
        args.json,
        args.verbose,
        found,
    )


if __name__ == "__main__":
    sys.exit(main())
