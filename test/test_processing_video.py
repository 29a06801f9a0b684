"""Video preprocessing: transformers' resize rule and timestamps, the token budget, and refused input."""

from __future__ import annotations

import numpy as np
import pytest

from orin_vlm_node.processing import ImageError, ImageProcessorConfig, Video, VideoProcessor
from orin_vlm_node.processing.video import even_pick, timestamp_text, video_smart_resize

CONFIG = ImageProcessorConfig(
    min_pixels=4096, max_pixels=25165824, patch_size=16, temporal_patch_size=2, merge_size=2,
    image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
)  # fmt: skip


def _video(count: int, h: int = 64, w: int = 96, fps: float = 2.0, seed: int = 0) -> Video:
    rng = np.random.default_rng(seed)
    frames = tuple(rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(count))
    return Video(frames, tuple(i / fps for i in range(count)))


@pytest.mark.parametrize("seconds", [0.0, 0.25, 0.75, 1.05, 3.5, 12.349])
def test_timestamps_are_written_as_qwens_processor_writes_them(seconds):
    assert timestamp_text(seconds) == f"<{seconds:.1f} seconds>"
    assert timestamp_text(0.25) == "<0.2 seconds>"  # Python rounds the binary value half to even


@pytest.mark.parametrize("frames", [2, 3, 4, 5, 8, 9, 30])
@pytest.mark.parametrize("size", [(20, 300), (64, 96), (720, 1280), (1080, 1920), (33, 31)])
def test_frame_size_follows_transformers_video_smart_resize(frames, size):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    for lo, hi in ((4096, 25165824), (4096, 16384 * frames), (128 * 32 * 32, 32 * 32 * 768)):
        want = smart_resize(frames, *size, temporal_factor=2, factor=32, min_pixels=lo, max_pixels=hi)
        assert video_smart_resize(frames, *size, 2, 32, lo, hi) == want


def test_odd_frame_count_repeats_the_last_frame_and_its_time():
    batch = VideoProcessor(CONFIG).preprocess([_video(3, fps=4.0)])
    (layout,) = batch.layouts
    assert layout.timestamps == ((0.0 + 0.25) / 2, 0.5)
    assert len(batch.groups.num_tokens) == 2 and batch.groups.grid_thw[:, 0].tolist() == [1, 1]
    # the second group's patch rows hold the third frame twice: its two temporal halves are equal
    rows = batch.groups.pixel_values[batch.groups.num_tokens[0] * 4 :].view(-1, 3, 2, 16 * 16)
    assert (rows[:, :, 0] == rows[:, :, 1]).all()


def test_uneven_times_are_told_as_given():
    video = Video(_video(4).frames, (0.0, 0.1, 0.9, 2.5))
    (layout,) = VideoProcessor(CONFIG).preprocess([video]).layouts
    assert layout.timestamps == pytest.approx((0.05, 1.7))


def test_frames_of_different_sizes_are_resized_together():
    a, b = _video(1, 64, 96).frames[0], _video(1, 120, 90, seed=1).frames[0]
    batch = VideoProcessor(CONFIG).preprocess([Video((a, b, a), (0.0, 0.5, 1.0))])
    assert len(set(map(tuple, batch.groups.grid_thw.tolist()))) == 1
    assert batch.layouts[0].size == VideoProcessor(CONFIG).frame_size(3, 64, 96)


def test_equal_frame_pairs_share_a_content_key():
    one = VideoProcessor(CONFIG).preprocess([_video(4)])
    shifted = Video(_video(4).frames[2:] + _video(2, seed=5).frames, (1.0, 1.5, 2.0, 2.5))
    two = VideoProcessor(CONFIG).preprocess([shifted])
    assert one.groups.digests[1] == two.groups.digests[0]  # the same frames: the vision cache reuses them
    assert one.groups.digests[0] != one.groups.digests[1]


@pytest.mark.parametrize("budget", [8, 30, 100, 400])
def test_a_token_budget_lowers_the_resolution_then_drops_frames_evenly(budget):
    processor = VideoProcessor(CONFIG)
    video = _video(60, 240, 320)
    batch = processor.preprocess([video], max_tokens=budget)
    (layout,) = batch.layouts
    assert sum(batch.groups.num_tokens) == layout.tokens <= budget
    assert layout.frames_given == 60
    h, w = layout.size
    assert h * w >= CONFIG.min_pixels  # frames are dropped rather than shrunk below the floor
    kept = [video.times[j] for j in even_pick(60, layout.frames_used)]  # evenly: the first and the last stay
    kept += kept[-1:] * (len(kept) % 2)
    assert layout.timestamps == pytest.approx([(a + b) / 2 for a, b in zip(kept[::2], kept[1::2], strict=True)])
    unbounded = processor.preprocess([video]).layouts[0]
    assert unbounded.frames_used == 60 and unbounded.tokens > budget


@pytest.mark.parametrize(
    ("video", "message"),
    [
        (Video((), ()), "no frames"),
        (Video(_video(2).frames, (0.0,)), "2 frames but 1 times"),
        (Video(_video(2).frames, (1.0, 0.5)), "backwards"),
        (Video(_video(2).frames, (0.0, float("nan"))), "finite"),
        (Video((np.zeros((4, 4), np.float32),), (0.0,)), "frame 0"),
    ],
)
def test_bad_videos_are_refused_with_the_reason(video, message):
    with pytest.raises(ImageError, match=message):
        VideoProcessor(CONFIG).preprocess([video])
