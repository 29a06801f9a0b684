"""``--video``: frame files or a video file as Qwen3-VL video input, the same request as the engine's."""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest
import torch

from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn, Video
from orin_vlm_node.generate import main
from support.checkpoints import cached_tiny_checkpoint

torch.set_num_threads(1)

CHECKPOINT = dict(layers=2, deepstack=(0, 1), tie=True, seed=21)
FLAGS = ["--temperature", "0", "--max-new-tokens", "12", "--device", "cpu", "--json"]


def _frames(count: int) -> list[np.ndarray]:
    """BGR frames of a square moving right."""
    frames = []
    for i in range(count):
        frame = np.full((64, 96, 3), 210, np.uint8)
        frame[20:40, 4 + i * 6 : 24 + i * 6] = (30, 30, 220)
        frames.append(frame)
    return frames


def _engine_answer(model, frames: list[np.ndarray], times: list[float]):
    engine = Engine(EngineConfig(model_path=str(model)))
    turn = Turn("Which way did it move?", color="bgr", videos=(Video(tuple(frames), tuple(times)),))
    return list(engine.generate(Request(turn, SamplingParams(temperature=0.0, max_new_tokens=12))))[-1]


def _run(capsys, *args: str) -> dict:
    assert main([*args, *FLAGS]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_frame_files_are_one_video_timed_by_the_rate(tmp_path, capsys):
    model = cached_tiny_checkpoint(**CHECKPOINT)
    frames = _frames(5)
    paths = []
    for i, frame in enumerate(frames):
        paths.append(str(tmp_path / f"f{i}.png"))
        cv2.imwrite(paths[-1], frame)
    out = _run(capsys, "--model-path", str(model), "--prompt", "Which way did it move?", "--video", *paths,
               "--video-fps", "4")  # fmt: skip
    final = _engine_answer(model, frames, [i / 4 for i in range(5)])
    assert out["token_ids"] == list(final.token_ids)
    assert out["metrics"]["prompt_tokens"] == final.metrics["prompt_tokens"]
    times = _run(capsys, "--model-path", str(model), "--prompt", "Which way did it move?", "--video", *paths,
                 "--video-times", "0,0.1,0.9,2.5,2.6")  # fmt: skip
    assert times["token_ids"] == list(_engine_answer(model, frames, [0, 0.1, 0.9, 2.5, 2.6]).token_ids)


def test_a_video_file_is_sampled_at_the_rate_by_its_timestamps(tmp_path, capsys):
    model = cached_tiny_checkpoint(**CHECKPOINT)
    path = tmp_path / "clip.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (96, 64))
    for frame in _frames(12):  # 0.0 .. 1.1 s
        writer.write(frame)
    writer.release()
    out = _run(capsys, "--model-path", str(model), "--prompt", "Which way did it move?", "--video", str(path),
               "--video-fps", "2")  # fmt: skip
    decoded = []
    capture = cv2.VideoCapture(str(path))
    while (frame := capture.read()[1]) is not None:
        decoded.append(frame)
    final = _engine_answer(model, [decoded[0], decoded[5], decoded[10]], [0.0, 0.5, 1.0])
    assert out["token_ids"] == list(final.token_ids)


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--video", "/nonexistent/clip.mp4"], "does not exist"),
        (["--video", "FRAME", "FRAME", "--video-times", "0"], "2 frame file(s) but 1 frame time(s)"),
        (["--video", "FRAME", "--video-fps", "0"], "above 0"),
        (["--video", "FRAME", "--video-times", "0,x"], "comma-separated"),
        (["--video", "GARBAGE"], "cannot read video file"),
        (["--video", "FRAME", "--detect", "cup"], "takes no --video"),
    ],
)
def test_bad_video_flags_exit_1_naming_why(tmp_path, capsys, extra, fragment):
    model = cached_tiny_checkpoint(**CHECKPOINT)
    frame = tmp_path / "frame.png"
    cv2.imwrite(str(frame), _frames(1)[0])
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"not a video")
    extra = [str(frame) if a == "FRAME" else str(garbage) if a == "GARBAGE" else a for a in extra]
    prompt = [] if "--detect" in extra else ["--prompt", "Hi"]
    assert main(["--model-path", str(model), *prompt, "--max-new-tokens", "2", *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and fragment in err
