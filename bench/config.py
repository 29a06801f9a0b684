"""Benchmark settings: one dataclass, three presets (quick for CI, medium, full).

Why presets instead of many flags: a result file is only comparable with another run of the same
preset, and the preset name plus this dataclass (stored in the JSON under ``config``) is the complete
description of what was run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.schema import SECTIONS

REPO = Path(__file__).resolve().parent.parent
CONFIG_2B = REPO.parent / "shared" / "model-configs" / "Qwen3-VL-2B-Instruct.config.json"


@dataclass(frozen=True)
class BenchConfig:
    mode: str = "full"
    threads: int = 0  # torch intra-op threads for every process of the run; 0 = torch's default
    repeats: int = 5  # recorded repeats per measurement (after one warm-up round)
    warmup: int = 1
    # engine vs transformers
    max_new_tokens: int = 128  # default model; fixed-length answers (ignore_eos)
    ttft_repeats: int = 30  # default model: alternating pairs of one-token answers for the TTFT figures
    big_max_new_tokens: int = 64  # 2B-shape checkpoint, text prompt (about half a second per token on 1 core)
    big_image_max_new_tokens: int = 2  # 2B image prompt: TTFT only (its decode is the text prompt's again)
    big_repeats: int = 5
    big_checkpoint: bool = True  # build and run the 2B-shape random checkpoint
    big_dtypes: tuple[str, ...] = ("bf16", "fp32")
    big_config_path: str = str(CONFIG_2B)
    checkpoint_cache: str = ""  # "" = build the 2B checkpoint in the run's temp dir; else reuse/build it here
    image_size: tuple[int, int] = (224, 224)  # H, W of the benchmark image (tiny/default model)
    big_image_size: tuple[int, int] = (128, 128)  # keeps the 24-layer vision tower cheap on 2 cores
    # paged vs contiguous
    context_lengths: tuple[int, ...] = (512, 4096, 16384)
    page_sizes: tuple[int, ...] = (4, 16, 64)
    paged_decode_tokens: int = 64
    paged_repeats: int = 9  # at 16k a repeat's median still moved by 20+ points with the host's memory traffic
    paged_layers: int = 2
    # prefix cache / sessions
    prefix_image_size: tuple[int, int] = (448, 448)
    prefix_max_new_tokens: int = 8
    # weight quantization: held-out samples of the default model's task per weight_quant mode (the accuracy goals)
    quant_held_out: int = 200
    detect_scenes: int = 100  # held-out grounding scenes the default model is scored on
    # ROS
    ros: bool = True
    ros_max_new_tokens: int = 400  # long answers: the per-token cost of publishing is what is measured
    # Fresh processes of the same engine decode up to 15% apart for their whole life on this host (six alive at
    # once, asked in turn: one was the slowest or next to it in 7 of 10 turns, its median 7% below the others),
    # while the host's own slow phases move every process together: one node process against one engine-alone
    # process compared two draws (31 pairs of one round moved the overhead's median between -2% and +11% from run
    # to run). So the section runs rounds, each with a fresh node and a fresh engine-alone process, and reduces
    # per round, then over rounds.
    ros_rounds: int = 16
    ros_repeats: int = 2  # alternating pairs per round
    ros_startup_timeout_s: float = 120.0
    # remote backend: a real vLLM on this CPU (skipped without its environment)
    remote: bool = True
    remote_chars: int = 800  # the answer's length (letters held by a regular expression; one token each or less)
    remote_repeats: int = 16  # alternating pairs (a 2-core host running vLLM, the node and the client is noisy)
    ros_idle_camera_s: float = 10.0  # per round: the node's CPU with a 30 Hz 720p camera and no prompt
    # video prompts: the same frames as one video, as separate images, and the last one alone
    video_frames: int = 8
    video_frame_size: tuple[int, int] = (448, 448)
    # continuous batching
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    batch_tokens: int = 64  # default model, per member (fixed length)
    big_batch_tokens: int = 16  # 2B-shape checkpoint: a third of a second per step on 1 core
    # GPU (CUDA only)
    gpu_dtypes: tuple[str, ...] = ("fp16", "bf16")
    gpu_max_new_tokens: int = 128  # fixed-length answers (ignore_eos), long enough for steady decode
    gpu_repeats: int = 3
    gpu_kernel_contexts: tuple[int, ...] = (1024, 4096, 16384)
    gpu_kernel_pages: tuple[int, ...] = (16, 64)
    # Split lengths the kernels part also times at the first page size, where longer than the engine's plan (the
    # plan's shortest split comes from the GPU's occupancy and the context's square root; a longer one is forced
    # with min_tokens_per_split): whether the plan still picks the fastest split after a kernel change.
    gpu_kernel_split_tokens: tuple[int, ...] = (64, 128, 256, 512)
    gpu_startup_context: int = 8192  # max_context_tokens of the startup/memory probe (the 2B preset's)
    gpu_budget_s: float = 0.0  # start no further part of the GPU section after this many seconds (0 = no limit)
    gpu_parts: tuple[str, ...] = ()  # the GPU section's parts to run, by name (empty: every part)
    # sections to run (all by default)
    sections: tuple[str, ...] = SECTIONS

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


FULL = BenchConfig()

# Documented middle ground when the full run does not fit the time available: the 2B-shape checkpoint
# in bf16 only and context lengths up to 4k with fewer repeats.
MEDIUM = replace(
    FULL,
    mode="medium",
    repeats=3,
    ttft_repeats=15,
    big_repeats=2,
    big_dtypes=("bf16",),
    paged_repeats=2,
    ros_rounds=3,
    ros_repeats=2,
)

# CI smoke test: every section runs (so the schema is exercised end to end) on the smallest settings;
# must finish in well under 3 minutes on a 2-core machine.
QUICK = replace(
    FULL,
    mode="quick",
    repeats=2,
    warmup=0,
    ttft_repeats=2,
    max_new_tokens=4,
    big_checkpoint=False,
    image_size=(64, 64),
    context_lengths=(64, 256),
    page_sizes=(4, 16),
    paged_decode_tokens=4,
    paged_repeats=1,
    paged_layers=1,
    prefix_image_size=(64, 64),
    prefix_max_new_tokens=2,
    video_frames=4,
    video_frame_size=(64, 64),
    batch_tokens=12,  # more steps than the largest batch has members: all of them decode together
    quant_held_out=40,
    detect_scenes=10,
    ros_max_new_tokens=32,  # several tokens messages at the default 20 ms period
    ros_rounds=2,  # the round loop runs in CI too
    ros_repeats=1,
    ros_startup_timeout_s=60.0,
    ros_idle_camera_s=1.0,
    remote=False,  # starting vLLM alone takes a minute or more here
)

PRESETS = {"full": FULL, "medium": MEDIUM, "quick": QUICK}


# The parts besides the decode of each dtype, in the order they run after the first dtype's decode.
OTHER_PARTS = ("step_profile", "startup_memory", "kernels", "gemv", "quant", "pdl", "l2_prefetch", "step_profile_int4",
               "batching")  # fmt: skip


def part_names(dtypes: Sequence[str], chosen: Sequence[str] = ()) -> list[str]:
    """The GPU section's parts in the order they run. Most wanted first: what a robot sees (decode, TTFT,
    startup, memory), then the kernels and the features; the other dtypes' decodes last. Parts ``chosen``
    (``--gpu-parts``) go first, in the order given (the others are then skipped as not selected)."""
    first, *others = dtypes
    names = [f"decode.{first}", *OTHER_PARTS, *(f"decode.{d}" for d in others)]
    return [*chosen, *(n for n in names if n not in chosen)]


def chosen_parts(text: str, dtypes: Sequence[str]) -> tuple[tuple[str, ...], list[str]]:
    """The parts named in ``text`` (comma-separated, ``--gpu-parts``), and those of them that are no part."""
    chosen = tuple(p.strip() for p in text.split(",") if p.strip())
    return chosen, [p for p in chosen if p not in part_names(dtypes)]
