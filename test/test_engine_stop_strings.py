"""Stop strings split over deltas: text is cut before the stop, deltas still concatenate."""

from __future__ import annotations

from orin_vlm_node.engine.stop_strings import StopStringMatcher


def _run(stops, pieces):
    m = StopStringMatcher(stops)
    out = [m.push(p) for p in pieces]
    if not m.stopped:
        out.append(m.flush())
    return "".join(out), m.stopped, out


def test_stop_split_across_pieces_is_cut():
    text, stopped, out = _run(("Observation:",), ["The cube. Obs", "erv", "ation: more", " text"])
    assert stopped and text == "The cube. "
    # The partial "Obs" was held back, not streamed and later retracted.
    assert out[0] == "The cube. "


def test_false_alarm_is_released():
    text, stopped, _ = _run(("STOP",), ["ab ST", "ART and S", "TO", "x"])
    assert not stopped and text == "ab START and STOx"


def test_earliest_of_several_stops_wins():
    text, stopped, _ = _run(("world", "lo"), ["hello world"])
    assert stopped and text == "hel"


def test_no_stops_passes_through():
    m = StopStringMatcher(())
    assert m.push("abc") == "abc" and m.flush() == ""


def test_multibyte_stop():
    text, stopped, _ = _run(("。",), ["你好", "世界。再见"])
    assert stopped and text == "你好世界"
