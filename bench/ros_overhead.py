"""Through ROS 2: prompt published -> first ``tokens`` message, and tokens/s seen by a subscriber,
against the same engine alone in a process of its own (bench/engine_worker.py): the ROS overhead.

The node runs as a subprocess (``support.node_process.NodeProcess``: own process group, private
domain, localhost-only discovery, temporary ROS_LOG_DIR, stopped with SIGINT to the group and SIGKILL
as fallback; the exit status is recorded) and is driven by ``support.node_client.VlmClient``.
Both sides are timed the same way, from the request (prompt publish / ``generate`` call) to the first
and last non-empty text delta, so the difference is what ROS adds: DDS delivery of prompt and tokens,
the node's queue, and its executor threads competing with generation. Engine-alone and ROS requests
alternate (run inside this process, the engine would share the GIL with the ROS client's executor
thread and look slower than it is), in rounds: each round starts a fresh node process and a fresh
engine-alone process, since a process's decode rate is a draw that holds for its life
(``_decode_figures``). The node's own engine metrics (``status`` topic) split the overhead into
"inside the node" and "delivery" (``delivery_overhead``).

Answers are long (``ros_max_new_tokens``, 400 in the full run) because per-token costs are what ROS adds
to: a random checkpoint with the default model's dimensions whose greedy answers never end on their own
(``BenchContext.talkative_checkpoint``), since the node takes no ``ignore_eos``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.context import BenchContext
from bench.section import SectionResult, skipped
from bench.stats import alternate, paired_ratio

PROMPT = "Describe the picture in one sentence."


def _vm_hwm_mb(pid: int) -> float | None:
    """Peak resident set of a process (the ROS wheels re-exec with execve, so the pid is the node's)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        pass
    return None


class _Stream:
    """What one side saw for one request: when it was sent, when each non-empty text delta arrived."""

    def __init__(self) -> None:
        self.t_publish = 0.0
        self.token_times: list[float] = []
        self.texts: list[str] = []
        self.finished: dict | None = None


@dataclass
class _Round:
    """One round: a fresh node process and a fresh engine-alone process, their alternating pairs."""

    engine: list[_Stream]
    ros: list[_Stream]
    startup_s: float
    idle_camera_cpu_pct: float = 0.0
    peak_rss_mb: float | None = None
    exit: dict = field(default_factory=dict)


def run(ctx: BenchContext) -> SectionResult:
    cfg = ctx.config
    if not cfg.ros:
        return skipped("ros", f"ROS section disabled in {cfg.mode} mode")
    try:
        import rclpy  # noqa: F401

        from support.node_client import VlmClient  # noqa: F401
        from support.node_process import NodeProcess, domain_id_for
    except ImportError as exc:
        return skipped("ros", f"rclpy or the node's process helpers not importable: {exc}")
    domain = domain_id_for("bench.ros_overhead")
    model_dir = ctx.talkative_checkpoint()
    what = "random weights, the default model's dimensions, EOS never greedy"
    n_new = cfg.ros_max_new_tokens
    params = {
        "model_path": str(model_dir),
        "device": "cpu",
        "dtype": "fp32",
        "prefix_caching": False,
        "max_new_tokens": n_new,
        "temperature": 0.0,
        "multi_turn": False,
        "image_max_age_s": 3600.0,
    }
    res = SectionResult("ros")
    res.setup.update(
        model=what,
        domain_id=domain,
        discovery="LOCALHOST",
        max_new_tokens=n_new,
        prompt=PROMPT,
        rounds=cfg.ros_rounds,
        pairs_per_round=cfg.ros_repeats,
    )
    rounds: list[_Round] = []
    for k in range(cfg.ros_rounds):
        ctx.log(f"ros: round {k + 1}/{cfg.ros_rounds}: starting node (domain {domain})")
        node = NodeProcess(params, ctx.scratch / f"ros_node{k}", domain)
        try:
            rnd = _round(ctx, node, model_dir, domain, k)
            rnd.peak_rss_mb = _vm_hwm_mb(node.proc.pid)
        finally:
            rc, stop_s = node.stop(timeout=20.0)
            if rc != 0:
                res.notes.append(
                    f"node of round {k} did not exit cleanly on SIGINT (exit {rc}): {node.output()[-500:]}"
                )
        rnd.exit = {"returncode": rc, "stop_s": round(stop_s, 2)}
        rounds.append(rnd)
    _figures(res, rounds)
    exits = ", ".join(str(r.exit["returncode"]) for r in rounds)
    res.setup["summary"] = (
        f"{what}; node subprocess on localhost DDS (domain {domain}); greedy, max {n_new} new tokens, one "
        f"{cfg.image_size[0]}x{cfg.image_size[1]} image; {cfg.ros_rounds} rounds of a fresh node process and a "
        f"fresh engine-alone process, {cfg.ros_repeats} alternating pairs each. Nodes stopped with SIGINT: "
        f"exit {exits}."
    )
    return res


def _start_worker(model_dir: Path, log_path: Path) -> subprocess.Popen:
    """The engine alone in its own process (bench/engine_worker.py), ready to take requests."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.engine_worker", str(model_dir), "fp32"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(log_path, "wb"),  # noqa: SIM115 - the child owns it; closed when the child exits
        text=True,
        start_new_session=True,
    )
    line = proc.stdout.readline().strip()
    if line != "ready":
        proc.kill()
        raise RuntimeError(f"engine worker did not start ({line!r}): {log_path.read_text(errors='replace')[-1500:]}")
    return proc


def _round(ctx: BenchContext, node, model_dir: Path, domain: int, k: int) -> _Round:
    """Alternating pairs (engine alone, through the node) against one node process and one worker."""
    from sensor_msgs.msg import Image

    from support.node_client import VlmClient

    cfg = ctx.config
    hw = list(cfg.image_size)
    image = ctx.image(*hw, seed=3)
    arrivals: list[tuple[float, str]] = []
    client = VlmClient(domain, on_token=lambda text: arrivals.append((time.perf_counter(), text)))
    worker = None
    try:
        t_start = time.perf_counter()
        client.wait_until_connected(node, timeout=cfg.ros_startup_timeout_s)
        startup_s = time.perf_counter() - t_start
        ctx.log(f"ros: node up after {startup_s:.1f} s; starting the engine-alone process")
        worker = _start_worker(model_dir, ctx.scratch / f"engine_worker{k}.log")
        msg = Image(
            height=image.shape[0], width=image.shape[1], encoding="rgb8", is_bigendian=0, step=image.shape[1] * 3
        )
        msg.data = image.tobytes()

        def through_ros() -> _Stream:
            client.publish_image(msg)
            s = _Stream()
            n = len(arrivals)
            s.t_publish = time.perf_counter()
            out = client.ask(PROMPT, timeout=300.0)
            if out["status"]["event"] != "finished":
                raise RuntimeError(f"node answered {out['status']}")
            s.finished = out["status"]
            s.token_times = [t for t, text in arrivals[n:] if text]
            s.texts = [text for _, text in arrivals[n:] if text]
            return s

        def alone() -> _Stream:
            job = {"text": PROMPT, "image_hw": hw, "seed": 3, "max_new_tokens": cfg.ros_max_new_tokens}
            worker.stdin.write(json.dumps(job) + "\n")
            worker.stdin.flush()
            out = json.loads(worker.stdout.readline())
            if "error" in out["metrics"] or out["first_token_s"] is None:
                raise RuntimeError(f"engine worker failed: {out}")
            s = _Stream()
            s.token_times = [out["first_token_s"], out["last_token_s"]]  # relative to its generate() call
            s.texts = out["texts"]
            s.finished = {"metrics": out["metrics"]}
            return s

        runs = alternate({"engine": alone, "ros": through_ros}, repeats=cfg.ros_repeats, warmup=cfg.warmup)
        idle_cpu = _idle_camera_cpu_pct(ctx, node, client)  # last: its frames must not reach the pairs' prompts
    finally:
        client.close()
        if worker is not None:
            worker.stdin.close()
            try:
                worker.wait(timeout=20)
            except subprocess.TimeoutExpired:
                worker.kill()
    return _Round(engine=runs["engine"], ros=runs["ros"], startup_s=startup_s, idle_camera_cpu_pct=idle_cpu)


def _process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _idle_camera_cpu_pct(ctx: BenchContext, node, client) -> float:
    """The node's CPU, in % of a core, while a 1280x720 JPEG camera publishes at 30 Hz and nobody asks: what a
    robot pays for the node between prompts (frames are decoded only when a prompt takes them)."""
    import cv2
    from sensor_msgs.msg import CompressedImage

    ok, jpeg = cv2.imencode(".jpg", ctx.image(720, 1280, seed=5)[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, 90])
    if not ok:
        raise RuntimeError("cannot encode the camera frame")
    msg = CompressedImage(format="jpeg")
    msg.data = jpeg.tobytes()
    period = 1 / 30
    for _ in range(15):  # matched and flowing before the clock starts
        client.compressed_pub.publish(msg)
        time.sleep(period)
    cpu0, t0, sent = _process_cpu_s(node.proc.pid), time.monotonic(), 0
    while time.monotonic() - t0 < ctx.config.ros_idle_camera_s:
        client.compressed_pub.publish(msg)
        sent += 1
        time.sleep(max(0.0, t0 + sent * period - time.monotonic()))
    return 100 * (_process_cpu_s(node.proc.pid) - cpu0) / (time.monotonic() - t0)


def _first(s: _Stream) -> float:
    if not s.token_times:
        raise RuntimeError("a request streamed no text")
    return s.token_times[0] - s.t_publish


def _tok_s(s: _Stream) -> float:
    n = int(s.finished["metrics"]["generated_tokens"])
    span = s.token_times[-1] - s.token_times[0]
    return (n - 1) / span if n > 1 and span > 0 else 0.0


def _figures(res: SectionResult, rounds: list[_Round]) -> None:
    from orin_vlm_node.ros.worker import wire_text

    e = [s for rnd in rounds for s in rnd.engine]
    r = [s for rnd in rounds for s in rnd.ros]
    e_first, r_first = [_first(s) for s in e], [_first(s) for s in r]
    res.add("engine.first_token_s", "s", e_first, "engine alone: generate() call -> first text delta", side="engine")
    res.add("ros.first_token_s", "s", r_first, "prompt published -> first tokens message", side="ros")
    res.add(
        "first_token_delay_s",
        "s",
        [a - b for a, b in zip(r_first, e_first, strict=True)],
        "first token over ROS minus engine alone (per pair)",
    )
    if all(_tok_s(s) for s in e + r):
        _decode_figures(res, rounds)
    else:  # one tokens message (everything coalesced): no span to time
        res.notes.append("answers too short to time their delivery (one tokens message): no decode figures")
    res.add(
        "node_engine.ttft_s",
        "s",
        [float(s.finished["metrics"]["ttft_s"]) for s in r],
        "the node's engine TTFT (status metrics)",
        side="ros",
    )
    res.add(
        "node_engine.decode_tok_s",
        "tok/s",
        [float(s.finished["metrics"]["decode_tokens_per_s"]) for s in r],
        "the node's engine decode tokens/s (status metrics)",
        side="ros",
    )
    res.add("node.startup_s", "s", [rnd.startup_s for rnd in rounds], "node process start -> connected (per round)")
    res.add(
        "node.idle_camera_cpu_pct",
        "% of a core",
        [rnd.idle_camera_cpu_pct for rnd in rounds],
        "node CPU with a 1280x720 JPEG camera at 30 Hz and no prompt (per round)",
    )
    peaks = [rnd.peak_rss_mb for rnd in rounds if rnd.peak_rss_mb is not None]
    if peaks:
        res.add("node.peak_rss_mb", "MB", peaks, "peak RSS of the node process (VmHWM) after its round's requests")
    res.setup["node_exits"] = [rnd.exit for rnd in rounds]
    res.setup["generated_tokens"] = {
        "engine": [int(s.finished["metrics"]["generated_tokens"]) for s in e],
        "ros": [int(s.finished["metrics"]["generated_tokens"]) for s in r],
    }
    # Same greedy request on both sides: a different answer (e.g. an image the node never received) times
    # different tokens, so every pair is checked and the mismatches named. The engine's text is compared as
    # the node sends it (a NUL the random model says arrives as U+FFFD).
    differing = [
        i for i, (a, b) in enumerate(zip(e, r, strict=True)) if wire_text("".join(a.texts)) != "".join(b.texts)
    ]
    res.setup["same_answers"] = not differing
    if differing:
        res.notes.append(f"the node's answer differs from the engine-alone answer in pairs {differing}")


def _decode_figures(res: SectionResult, rounds: list[_Round]) -> None:
    """Decode rates seen by the engine alone and by the subscriber, and what ROS adds to them.

    The overhead is taken per round, then over rounds: fresh processes of the same engine decode at rates
    up to 15% apart for their whole life on this host (within a process repeats agree to about 3%), so
    pairs inside one round share their two processes' draw and only more rounds average it out."""
    per_round = [([_tok_s(s) for s in rnd.engine], [_tok_s(s) for s in rnd.ros]) for rnd in rounds]
    e_tps = [x for engine, _ in per_round for x in engine]
    r_tps = [x for _, ros in per_round for x in ros]
    node_tps = [float(s.finished["metrics"]["decode_tokens_per_s"]) for rnd in rounds for s in rnd.ros]
    res.add("engine.decode_tok_s", "tok/s", e_tps, "engine alone: tokens/s between first and last delta", side="engine")
    res.add(
        "ros.decode_tok_s", "tok/s", r_tps, "subscriber: tokens/s between first and last tokens message", side="ros"
    )
    pair_overhead = [x - 1.0 for x in paired_ratio(e_tps, r_tps)]
    res.add(
        "decode_overhead_pairs",
        "fraction",
        pair_overhead,
        "subscriber time per token / engine-alone time per token - 1 (per pair, all rounds)",
    )
    round_overhead = [statistics.median(x - 1.0 for x in paired_ratio(engine, ros)) for engine, ros in per_round]
    res.add(
        "decode_overhead",
        "fraction",
        round_overhead,
        "per round (a fresh node and a fresh engine-alone process): the median over its pairs of subscriber "
        "time per token / engine-alone time per token - 1",
    )
    # Splits the overhead: the node's own engine metrics vs what the subscriber saw of the same request.
    res.add(
        "delivery_overhead",
        "fraction",
        [x - 1.0 for x in paired_ratio(node_tps, r_tps)],
        "subscriber time per token / the node's engine time per token - 1 (DDS + publishing only)",
    )
