"""One PNG summarising a result file (matplotlib, headless): medians as bars/lines, min..max as error bars,
goal thresholds as dashed lines, and the reason in place of a panel whose section did not run.

Usage: ``python -m bench.chart bench/results/latest.json [out.png]`` (run.py calls :func:`write_chart`).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _figs(result: dict[str, Any], section: str) -> dict[str, dict[str, Any]] | None:
    sec = result["sections"].get(section, {})
    return sec.get("figures") if sec.get("status") == "ok" else None


def _reason(ax, result: dict[str, Any], section: str, title: str) -> None:
    sec = result["sections"].get(section, {})
    ax.set_title(title, fontsize=9)
    ax.axis("off")
    text = f"{sec.get('status', 'missing')}: {sec.get('reason', '')}"
    ax.text(
        0.5,
        0.5,
        "\n".join(text[i : i + 48] for i in range(0, min(len(text), 240), 48)),
        ha="center",
        va="center",
        fontsize=8,
        wrap=True,
    )


def _bars(ax, items: list[tuple[str, dict[str, Any]]], title: str, ylabel: str, goal: float | None = None) -> None:
    names = [n for n, _ in items]
    med = [f["median"] for _, f in items]
    err = [[f["median"] - f["min"] for _, f in items], [f["max"] - f["median"] for _, f in items]]
    ax.bar(range(len(items)), med, yerr=err, capsize=3, color="#4878a8")
    ax.set_xticks(range(len(items)), names, rotation=35, ha="right", fontsize=7)
    ax.set_title(title, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=8)
    if goal is not None:
        ax.axhline(goal, color="#c03030", linestyle="--", linewidth=1, label=f"goal {goal:g}")
        ax.legend(fontsize=7)


def _vs_transformers(ax, result):
    figs = _figs(result, "vs_transformers")
    if not figs:
        return _reason(ax, result, "vs_transformers", "engine vs transformers")
    items = [(k.replace(".decode_ratio", " decode"), f) for k, f in figs.items() if k.endswith(".decode_ratio")]
    items += [(k.replace(".ttft_ratio", " TTFT"), f) for k, f in figs.items() if k.endswith(".ttft_ratio")]
    _bars(ax, items, "engine / transformers (decode goal >= 1.5, TTFT goal <= 0.8)", "ratio", None)
    ax.axhline(1.5, color="#c03030", linestyle="--", linewidth=1)
    ax.axhline(0.8, color="#30a030", linestyle="--", linewidth=1)


def _paged(ax_tps, ax_over, result):
    figs = _figs(result, "paged_vs_contiguous")
    if not figs:
        _reason(ax_tps, result, "paged_vs_contiguous", "paged vs contiguous")
        return _reason(ax_over, result, "paged_vs_contiguous", "paged overhead")
    series: dict[str, dict[int, dict[str, Any]]] = {}
    over: dict[str, dict[int, dict[str, Any]]] = {}
    for key, f in figs.items():
        m = re.fullmatch(r"ctx(\d+)\.(\w+)\.(decode_tok_s|decode_overhead)", key)
        if m:
            target = series if m.group(3) == "decode_tok_s" else over
            target.setdefault(m.group(2), {})[int(m.group(1))] = f
    for name, pts in sorted(series.items()):
        xs = sorted(pts)
        ax_tps.plot(xs, [pts[x]["median"] for x in xs], marker="o", label=name)
    ax_tps.set_xscale("log", base=2)
    ax_tps.set_title("decode tok/s vs context", fontsize=9)
    ax_tps.set_xlabel("context tokens", fontsize=8)
    ax_tps.legend(fontsize=7)
    for name, pts in sorted(over.items()):
        xs = sorted(pts)
        ax_over.plot(xs, [100 * pts[x]["median"] for x in xs], marker="o", label=name)
    ax_over.axhline(5, color="#c03030", linestyle="--", linewidth=1, label="goal 5%")
    ax_over.set_xscale("log", base=2)
    ax_over.set_title("paged decode overhead vs contiguous (%)", fontsize=9)
    ax_over.set_xlabel("context tokens", fontsize=8)
    ax_over.legend(fontsize=7)


def _prefix(ax, result):
    figs = _figs(result, "prefix_cache")
    if not figs:
        return _reason(ax, result, "prefix_cache", "prefix cache")
    items = [(k.replace(".ttft_s", ""), f) for k, f in figs.items() if k.endswith(".ttft_s")]
    _bars(ax, items, "TTFT: prefix cache / session reuse (log)", "s")
    ax.set_yscale("log")  # the 2B-shape checkpoint's TTFT is ~100x the default model's


def _ros(ax, result):
    figs = _figs(result, "ros")
    if not figs:
        return _reason(ax, result, "ros", "through ROS")
    keys = ["engine.first_token_s", "ros.first_token_s"]
    items = [(k, figs[k]) for k in keys if k in figs]
    _bars(ax, items, "first token: engine alone vs over ROS", "s")
    rate = [figs.get("engine.decode_tok_s"), figs.get("ros.decode_tok_s")]
    if all(rate):
        ax.text(
            0.02,
            0.95,
            f"decode tok/s: engine {rate[0]['median']:.1f}, ROS {rate[1]['median']:.1f}",
            transform=ax.transAxes,
            fontsize=7,
            va="top",
        )


def _memory(ax, result):
    figs = _figs(result, "memory")
    if not figs:
        return _reason(ax, result, "memory", "memory")
    # The 2B projection shows the paged/contiguous contrast at realistic sizes; measured tiny-model KV and
    # the RSS figures are orders of magnitude apart, so they go in as text.
    items = [
        (k.replace("projected.Qwen3-VL-2B-Instruct.", "2B ").replace("_mb", ""), f)
        for k, f in figs.items()
        if k.startswith("projected.Qwen3-VL-2B") and k.endswith(("paged_mb", "contiguous_mb"))
    ]
    if items:
        _bars(ax, items, "KV held per conversation, Qwen3-VL-2B (MB)", "MB")
        ax.set_yscale("log")
    else:
        ax.set_title("memory", fontsize=9)
    rss = figs.get("engine.peak_rss_mb")
    if rss:
        ax.text(0.02, 0.95, f"engine peak RSS {rss['median']:.0f} MB", transform=ax.transAxes, fontsize=7, va="top")


def _gpu(ax, result):
    figs = _figs(result, "gpu")
    if not figs:
        return _reason(ax, result, "gpu", "GPU")
    items = [(k, f) for k, f in figs.items() if f["unit"] == "tok/s"]
    _bars(ax, items, "GPU decode tok/s", "tok/s")


def write_chart(result: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(2, 4, figsize=(18, 8.5))
    _vs_transformers(axes[0][0], result)
    _paged(axes[0][1], axes[0][2], result)
    _prefix(axes[0][3], result)
    _ros(axes[1][0], result)
    _memory(axes[1][1], result)
    _gpu(axes[1][2], result)
    m = result["machine"]
    axes[1][3].axis("off")
    axes[1][3].text(
        0,
        1,
        f"mode {result['mode']}\n{result['created']}\n{m['cpu_model']}\n{m['cores']} cores, "
        f"{m['ram_gib']} GiB\ntorch {m['torch']}\ntransformers {m['transformers']}\n"
        f"commit {(m.get('git_commit') or '?')[:10]}",
        va="top",
        fontsize=8,
    )
    fig.suptitle("orin_vlm_node benchmarks (median, min..max over repeats)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    src = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".png")
    write_chart(json.loads(src.read_text()), out)
    print(f"wrote {out}")
