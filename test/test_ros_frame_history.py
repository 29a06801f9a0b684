"""The cameras' video history: sampling by header stamps, bounds in time and memory, stamps out of order,
what a prompt takes and what it is told; and a prompt's ``"video"`` request."""

from __future__ import annotations

import json

import numpy as np
import pytest

from orin_vlm_node.ros.frame_history import FrameHistory, HistorySettings, scaled
from orin_vlm_node.ros.prompt_message import json_prompt

SETTINGS = HistorySettings(seconds=10.0, fps=2.0, frame_pixels=64 * 48, max_bytes=64 * 2**20)


def _frame(value: int, h: int = 48, w: int = 64) -> np.ndarray:
    return np.full((h, w, 3), value % 256, np.uint8)


def _feed(history: FrameHistory, topic: str, stamps, settings: HistorySettings = SETTINGS) -> list[float]:
    """Offer frames stamped ``stamps`` as the intake does; the stamps it took."""
    taken = []
    for i, stamp in enumerate(stamps):
        if history.wants(topic, stamp, settings):
            history.add(topic, stamp, _frame(i), settings)
            taken.append(stamp)
    return taken


def test_a_30_hz_camera_is_kept_at_the_history_rate_for_the_history_span():
    history = FrameHistory(["front"])
    _feed(history, "front", [100 + i / 30 for i in range(30 * 14)])  # 14 s at 30 Hz
    ((topic, frames, size, span),) = history.stats()
    assert topic == "front" and span <= 10.0 and frames == 21  # 2 a second over 10 s, both ends included
    assert size == frames * 48 * 64 * 3


def test_a_clip_is_the_last_seconds_at_the_asked_rate_timed_from_its_first_frame():
    history = FrameHistory(["front"])
    newest = _feed(history, "front", [50 + i / 30 for i in range(30 * 12)])[-1]
    clip = history.clip("front", 4.0, 1.0, max_age_s=5.0)
    times = clip.video.times
    assert times[0] == 0.0 and times[-1] <= 4.0 + 1e-6 and len(times) == 5
    assert all(b - a >= 1.0 - 1e-6 for a, b in zip(times, times[1:], strict=False))
    assert clip.first_stamp + times[-1] == pytest.approx(newest)  # it ends with the newest frame kept
    assert clip.said is None


def test_a_longer_span_than_kept_uses_what_is_kept_and_says_so():
    history = FrameHistory(["front"])
    _feed(history, "front", [i / 2 for i in range(7)])  # 3 s kept
    clip = history.clip("front", 8.0, 2.0, max_age_s=5.0)
    assert len(clip.video.frames) == 7 and "3.0 s of history kept, 8 s asked" in clip.said


def test_stamps_out_of_order_are_put_in_order_and_told_once():
    history = FrameHistory(["front"])
    _feed(history, "front", [1.0, 2.0, 1.5, 2.0, 3.0])  # 1.5 goes back in time, 2.0 repeats
    clip = history.clip("front", 10.0, 30.0, max_age_s=5.0)
    assert clip.video.times == (0.0, 0.5, 1.0, 2.0)
    assert "1 put in order, 1 with a repeated stamp dropped" in clip.said
    assert history.clip("front", 2.0, 30.0, max_age_s=5.0).said is None  # told with one video, not again


def test_a_camera_clock_that_restarts_starts_the_history_over():
    history = FrameHistory(["front"])
    _feed(history, "front", [1000.0, 1000.5, 1001.0, 3.0, 3.5])  # a replayed bag: stamps from 3 s again
    clip = history.clip("front", 10.0, 30.0, max_age_s=5.0)
    assert clip.first_stamp == 3.0 and clip.video.times == (0.0, 0.5)


def test_memory_is_bounded_across_cameras_and_the_largest_gives_first():
    frame = 48 * 64 * 3
    settings = HistorySettings(seconds=600.0, fps=2.0, frame_pixels=64 * 48, max_bytes=10 * frame)
    history = FrameHistory(["front", "rear"])
    _feed(history, "front", [i / 2 for i in range(40)], settings)
    _feed(history, "rear", [i / 2 for i in range(3)], settings)
    stats = {topic: (frames, size) for topic, frames, size, _ in history.stats()}
    assert sum(size for _, size in stats.values()) <= 10 * frame
    assert stats["rear"][0] == 3 and stats["front"][0] == 7  # the newest seven of 40
    assert history.clip("front", 3.0, 2.0, 5.0).first_stamp + 2.5 == 19.5  # from the 34th: pairs at even places


def test_kept_frames_are_scaled_down_to_the_pixel_bound_keeping_the_aspect():
    small = scaled(_frame(3, 720, 1280), 256_000)
    assert small.shape[0] * small.shape[1] <= 256_000 and abs(small.shape[1] / small.shape[0] - 16 / 9) < 0.01
    same = _frame(3)
    assert scaled(same, 10**6) is same


def test_a_video_prompt_takes_every_camera_and_names_those_without_frames():
    history = FrameHistory(["front", "wrist"])
    _feed(history, "front", [0.0, 0.5, 1.0])
    picked = history.pick(["front", "wrist"], 5.0, 2.0, max_age_s=5.0)
    assert len(picked.videos) == 1 and picked.used == (("front", 3, 0.0, 1.0),)
    assert "no frame from wrist in the video history yet" in picked.note
    with pytest.raises(ValueError, match="no frame from wrist"):
        history.pick(["wrist"], 5.0, 2.0, max_age_s=5.0)
    with pytest.raises(ValueError, match=r"arrived .* s ago \(image_max_age_s=0\)"):
        history.pick(["front"], 5.0, 2.0, max_age_s=0.0)


@pytest.mark.parametrize(
    ("video", "want"),
    [(4, {"seconds": 4.0}), ({"seconds": 2.5, "fps": 1}, {"seconds": 2.5, "fps": 1.0})],
)
def test_a_prompt_asks_for_video_in_seconds_and_a_rate(video, want):
    assert json_prompt(json.dumps({"prompt": "Which way?", "video": video})).video == want


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ('{"prompt": "x", "video": 0}', "seconds must be a number above 0"),
        ('{"prompt": "x", "video": {"seconds": 3, "fps": 0}}', "fps must be a number above 0"),
        ('{"prompt": "x", "video": {"seconds": 3, "fps": -2}}', "fps must be a number above 0"),
        ('{"prompt": "x", "video": true}', '"video" must be seconds'),
        ('{"prompt": "x", "video": {"fps": 2}}', '"video" must be seconds'),
        ('{"prompt": "x", "video": {"seconds": 2, "rate": 2}}', '"video" must be seconds'),
        ('{"detect": "cup", "video": 3}', "not in video"),
    ],
)
def test_a_bad_video_request_is_refused_naming_why(data, message):
    with pytest.raises(ValueError, match=message):
        json_prompt(data)


def test_a_channel_with_video_seconds_sends_video_instead_of_frames_but_detections_keep_frames():
    from orin_vlm_node.ros.image import PickedFrames
    from orin_vlm_node.ros.params import defaults
    from orin_vlm_node.ros.prompt_message import pending_prompt, plain_prompt

    history = FrameHistory(["image"])
    _feed(history, "image", [0.0, 0.5, 1.0, 1.5])
    values = {**defaults(), "video_seconds": 1.0, "video_fps": 2.0}
    latest = PickedFrames(images=(_frame(3),), used=(("image", 1.5),))
    item = pending_prompt("r1", plain_prompt("What changed?"), values, latest, "", history)
    assert item.frames.images == () and item.videos.used == (("image", 2, 1.0, 1.5),)  # pairs at even places
    assert item.status_fields()["videos"] == item.videos.used
    detect = pending_prompt("r2", json_prompt('{"detect": "cup"}'), values, latest, "", history)
    assert detect.videos.videos == () and detect.frames is latest
    off = pending_prompt("r3", plain_prompt("What is this?"), {**values, "video_seconds": 0.0}, latest, "", history)
    assert off.videos.videos == () and off.frames is latest


def _pairs(video) -> set[tuple[int, int]]:
    """The frame pairs (temporal patches) a video becomes, by the frames' identity; an odd last frame alone."""
    return {(id(a), id(b)) for a, b in zip(video.frames[::2], video.frames[1::2], strict=False)}


def test_later_prompts_over_an_overlapping_span_get_the_same_frame_pairs():
    history = FrameHistory(["front"])
    _feed(history, "front", [i / 2 for i in range(13)])
    first = _pairs(history.clip("front", 3.5, 2.0, max_age_s=5.0).video)
    for n in (13, 14, 15):  # one, two, three frames later
        history.add("front", n / 2, _frame(n), SETTINGS)
        later = _pairs(history.clip("front", 3.5, 2.0, max_age_s=5.0).video)
        assert len(later & first) >= 2, n  # without the alignment an odd shift shares no pair
