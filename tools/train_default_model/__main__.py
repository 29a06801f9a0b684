"""Command line: ``python -m tools.train_default_model [--out DIR] [--<recipe field> VALUE ...] [--eval-only]``."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import torch

from . import __doc__ as PACKAGE_DOC
from .evaluation import eval_checkpoint
from .recipe import TrainConfig
from .training import train

REPO_ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=PACKAGE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "orin_vlm_node" / "default_model")
    for f in fields(TrainConfig):  # one flag per recipe field: --vision-steps sets vision_steps, ...
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    ap.add_argument("--save-every", type=int, default=0, help="also save <out>_step<N> snapshots every N steps")
    ap.add_argument("--eval-every", type=int, default=0, help="score on held-out samples every N steps (0: off)")
    ap.add_argument("--eval-n", type=int, default=200)
    ap.add_argument("--eval-only", action="store_true", help="only score the checkpoint in --out")
    ap.add_argument(
        "--allow-hf-pixels",
        action="store_true",
        help="fall back to transformers' PIL image processor if orin_vlm_node.processing is missing",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.eval_only:
        cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
        train(cfg, args.out, args.allow_hf_pixels, args.eval_every, args.eval_n, args.save_every)
    eval_checkpoint(args.out, args.eval_n, args.allow_hf_pixels)


if __name__ == "__main__":
    main()
