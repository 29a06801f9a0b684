"""The remote section's figures (bench/remote_overhead.py) from the answers it timed: each node answer is
paired with the direct client's answer next to it; the added TTFT is split from the frame's encoding. The
section itself needs a vLLM (``make vllm-env``) and runs in ``make bench``."""

from __future__ import annotations

import pytest

from bench.remote_overhead import _figures
from bench.schema import validate_figure
from bench.section import SectionResult


def test_figures_pair_each_node_answer_with_the_direct_one_beside_it():
    res = SectionResult("remote")
    runs = {  # (TTFT s, first to last text s, tokens)
        "direct": [(0.010, 1.0, 401.0), (0.020, 2.0, 801.0)],
        "node": [(0.015, 1.0, 381.0), (0.030, 2.0, 801.0)],
    }
    _figures(res, runs, encode_ms=[1.0, 2.0])
    assert res.figures["decode_tokens_per_s.direct"].samples == [400.0, 400.0]
    assert res.figures["decode_ratio"].samples == pytest.approx([0.95, 1.0])
    assert res.figures["ttft_added_ms"].samples == pytest.approx([5.0, 10.0])
    assert res.figures["ttft_added_beyond_encoding_ms"].samples == pytest.approx([4.0, 8.0])
    for key, figure in res.figures.items():
        validate_figure(figure.as_dict(), key)
