"""Run the node the way a robot does for a while and check it stays whole: ``python -m tools.soak``.

The node (the installed ``vlm_node`` when there is one, the embedded default model unless ``--model-path``)
sees a 1280x720 JPEG camera the whole time (a few distinct frames in turn, so the vision cache churns) and
a random mix of what operators and other nodes do: bursts of prompts past ``max_queue``, single prompts,
prompts long enough to fill a multi-turn conversation, ``~/cancel`` mid-answer, ``~/reset``, and runtime
parameter changes (paging, page size, prefix caching, multi-turn, batch size, sampling, dtype), often while a
prompt runs. With ``--managed`` it runs the lifecycle node, which it also deactivates mid-answer and activates
again; ``--param`` sets startup settings. The mix is drawn from ``--seed``; the timing is the machine's, so
two runs differ in detail.

It checks what must hold whatever the timing: every prompt it sent ends with exactly one ``finished``,
``dropped`` or ``error`` event of its request id (the node numbers prompts ``req-1``, ``req-2``, ... as they
arrive; an ``error`` of no prompt, a bad camera frame, counts for none); every parameter change is applied or
refused with a reason; the floor of the node's resident memory (all its processes, sampled every 15 s) rises
by no more than ``--max-growth-mb`` after the warm-up (``--warmup-s``: model reloads, allocator pools and caches fill
first); the camera published at the rate asked; the node logs no traceback, reports nothing above OK on
``/diagnostics``, is alive at the end and stops with exit code 0 on SIGINT. It prints a summary, writes it as
JSON with ``--out`` and exits non-zero when a check fails. It runs in ``ROS_DOMAIN_ID`` when that is set.
Why a tool and not a test: it found a crash no test had (a setting changed twice while a prompt ran), but only
after minutes of such traffic; the tests keep the case it found.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import yaml

WORDS = "describe the scene what color is the box count the objects is there a person in view answer briefly".split()
PARAMETER_CHANGES: list[tuple[str, list[Any]]] = [
    ("max_new_tokens", [8, 32, 64, 96]),
    ("use_paged_attention", [True, False]),
    ("page_size", [8, 16, 32]),
    ("multi_turn", [True, False]),
    ("prefix_caching", [True, False]),
    ("vision_cache_images", [0, 2, 4]),
    ("temperature", [0.0, 0.7]),
    ("max_batch", [1, 2, 4]),
    ("dtype", ["fp32", "bf16", "auto"]),  # reloads the model
]


def camera_frames(count: int, seed: int) -> list[bytes]:
    """``count`` distinct 1280x720 JPEGs: a flat colour with a patch of noise in a different place each."""
    rng = np.random.default_rng(seed)
    frames = []
    for i in range(count):
        image = np.full((720, 1280, 3), rng.integers(0, 256, 3), dtype=np.uint8)
        image[80 * i : 80 * i + 200, 200:600] = rng.integers(0, 256, (200, 400, 3))
        frames.append(cv2.imencode(".jpg", image)[1].tobytes())
    return frames


def group_rss_mb(group: int) -> float:
    """Resident memory of every process in process group ``group`` (the node and anything it started)."""
    total_kb = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[2]) != group:
                continue
            status = Path(f"/proc/{entry}/status").read_text().splitlines()
        except (OSError, IndexError, ValueError):  # the process ended meanwhile
            continue
        total_kb += sum(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return total_kb / 1024


def _ends_prompt(event: dict[str, Any]) -> bool:
    """A prompt's terminal event (an ``error`` without a request id reports a camera frame, no prompt)."""
    return event["event"] in ("finished", "dropped", "error") and event["request_id"] is not None


def memory_growth_problems(rss: list[tuple[float, float, int]], warmup_s: float, max_growth_mb: float) -> list[str]:
    """The node's growth after the warm-up beyond ``max_growth_mb``: the rise of its floor, from the lowest sample
    of the first third after ``warmup_s`` to the lowest of the last third (``rss``: (seconds, MB, prompts)
    samples). A leak raises the floor; a reload's working copies are a peak that goes again."""
    after = [mb for seconds, mb, _ in rss if seconds >= warmup_s]
    if len(after) < 3:
        return [f"fewer than three memory samples after the {warmup_s:g} s warm-up: run longer"]
    third = len(after) // 3
    first, last = min(after[:third]), min(after[-third:])
    if last - first > max_growth_mb:
        return [f"memory grew by {last - first:.0f} MB after the warm-up (its floor {first:.0f} -> {last:.0f} MB), "
                f"more than {max_growth_mb:g} MB"]  # fmt: skip
    return []


class Soak:
    """The client side: the camera thread, the actions, the bookkeeping of prompts and refusals."""

    def __init__(self, client: Any, node: Any, rng: random.Random, frames: list[bytes], managed: bool = False) -> None:
        self.client, self.node, self.rng, self.frames = client, node, rng, frames
        self.camera_published = 0
        self.camera_s = 0.0
        self.managed = managed  # the lifecycle node: deactivated and activated again among the actions
        self.sent = 0
        self.actions: dict[str, int] = {}
        self.refused: list[str] = []
        self.failed_transitions: list[str] = []
        self.rss: list[tuple[float, float, int]] = []  # (seconds, MB, prompts sent)
        self._stop = threading.Event()
        self._scanned = self._ends = 0

    def camera(self, hz: float) -> None:
        """Publish a frame every 1/hz s on a fixed schedule (a frame it is late for is skipped, not sent in a
        burst); each distinct frame for 3 s in turn. The messages are built once: only the stamp changes."""
        from sensor_msgs.msg import CompressedImage

        messages = [CompressedImage(format="jpeg", data=frame) for frame in self.frames]
        t0, tick = time.monotonic(), 0
        while not self._stop.is_set():
            msg = messages[int(tick / hz / 3.0) % len(messages)]
            msg.header.stamp = self.client.node.get_clock().now().to_msg()
            self.client.compressed_pub.publish(msg)
            self.camera_published += 1
            tick = max(tick + 1, int((time.monotonic() - t0) * hz))
            self._stop.wait(max(0.0, t0 + tick / hz - time.monotonic()))
        self.camera_s = time.monotonic() - t0

    def _ended(self) -> int:
        """Terminal events of prompts so far, counting only the events that came since the last call (a soak
        collects tens of thousands, and this runs on every message the client receives while it waits)."""
        new = self.client.status[self._scanned :]
        self._scanned += len(new)
        self._ends += sum(1 for event in new if _ends_prompt(event))
        return self._ends

    def _wait_all_ended(self, timeout: float = 300.0) -> None:
        self.client.wait_for(lambda: self._ended() >= self.sent, timeout, f"{self.sent} prompts to end")

    def _prompt(self, words: int) -> None:
        self.client.send_prompt(" ".join(self.rng.choice(WORDS) for _ in range(words)))
        self.sent += 1

    def step(self) -> None:
        actions = ["burst", "burst", "burst", "single", "long", "parameter", "cancel", "reset"]
        action = self.rng.choice([*actions, "lifecycle"] if self.managed else actions)
        self.actions[action] = self.actions.get(action, 0) + 1
        if action == "burst":  # more than max_queue at once: the oldest waiting ones are dropped
            for _ in range(self.rng.randint(2, 9)):
                self._prompt(self.rng.randint(2, 60))
        elif action in ("single", "long"):  # long prompts fill a multi-turn conversation
            self._prompt(self.rng.randint(2, 60) if action == "single" else 600)
        elif action == "parameter":
            name, values = self.rng.choice(PARAMETER_CHANGES)
            value = self.rng.choice(values)
            (result,) = self.client.set_params({name: value})
            if not result.successful:
                self.refused.append(f"{name}={value!r}: {result.reason}")
            return  # no wait: the next action often finds the change still waiting for a running prompt
        elif action == "cancel":
            self._prompt(40)
            time.sleep(self.rng.uniform(0.05, 1.0))
            self.client.trigger("cancel")
        elif action == "lifecycle":  # deactivated mid-answer: the answer ends cancelled; then active again
            self._prompt(40)
            time.sleep(self.rng.uniform(0.0, 0.5))
            self._transition("deactivate")
            self._wait_all_ended()
            self.client.wait_for(
                lambda: self.client.prompt_pub.get_subscription_count() == 0, 30.0, "the prompt subscription to go"
            )
            self._transition("activate")
            self.client.wait_until_connected(self.node)
            return
        else:
            self.client.trigger("reset")
            return
        self._wait_all_ended()

    def _transition(self, label: str) -> None:
        if not self.client.change_state(label):
            self.failed_transitions.append(f"lifecycle {label} refused")

    def run(self, duration_s: float, camera_hz: float) -> None:
        camera = threading.Thread(target=self.camera, args=(camera_hz,), name="soak_camera", daemon=True)
        camera.start()
        t0, next_sample = time.monotonic(), 0.0
        try:
            while (elapsed := time.monotonic() - t0) < duration_s:
                if elapsed >= next_sample:
                    self.rss.append((round(elapsed, 1), round(group_rss_mb(self.node.proc.pid), 1), self.sent))
                    next_sample = elapsed + min(15.0, duration_s / 20)
                self.step()
            self._wait_all_ended()
            self.rss.append((round(time.monotonic() - t0, 1), round(group_rss_mb(self.node.proc.pid), 1), self.sent))
        finally:
            self._stop.set()
            camera.join(5.0)  # before the client closes: a publish on a destroyed publisher raises

    def problems(self, warmup_s: float, max_growth_mb: float, camera_hz: float) -> list[str]:
        """What broke the checks (empty: all held)."""
        ends: dict[str, int] = {}
        for event in self.client.events():
            if _ends_prompt(event):
                ends[event["request_id"]] = ends.get(event["request_id"], 0) + 1
        expected = {f"req-{i}" for i in range(1, self.sent + 1)}
        missing = sorted(expected - set(ends))
        found = [f"{len(missing)} prompts never ended, the first: {missing[0]}"] if missing else []
        found += [f"{rid} ended {n} times" for rid, n in ends.items() if n != 1]
        found += [f"an end of a prompt never sent: {rid}" for rid in sorted(set(ends) - expected)]
        found += [f"refused without a reason: {r}" for r in self.refused if r.endswith(": ")]
        found += memory_growth_problems(self.rss, warmup_s, max_growth_mb)
        rate = self.camera_published / self.camera_s if self.camera_s else 0.0
        if rate < 0.9 * camera_hz:
            found.append(f"the camera published {rate:.1f} frames/s, not the {camera_hz:g} asked")
        found += self.failed_transitions
        if not self.node.alive():
            found.append("the node died")
        from diagnostic_msgs.msg import DiagnosticStatus

        warned = [  # every report is the node's: it is alone in the soak's ROS domain
            f"{status.message} ({', '.join(f'{v.key}={v.value}' for v in status.values[:3])})"
            for array in self.client.diagnostics
            for status in array.status
            if status.level != DiagnosticStatus.OK
        ]
        if warned:
            found.append(f"{len(warned)} /diagnostics reports above OK, the first: {warned[0]}")
        if not self.client.diagnostics:
            found.append("no /diagnostics report arrived")
        return found

    def summary(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        reasons: dict[str, int] = {}
        for event in self.client.events():
            kinds[event["event"]] = kinds.get(event["event"], 0) + 1
            if event["event"] == "finished":
                reasons[event["finish_reason"]] = reasons.get(event["finish_reason"], 0) + 1
        notes = [e["note"] for e in self.client.events(event="finished") if "started over" in (e["note"] or "")]
        return {
            "prompts": self.sent,
            "camera_frames_per_s": round(self.camera_published / self.camera_s, 2) if self.camera_s else 0.0,
            "events": kinds,
            "finish_reasons": reasons,
            "conversations_started_over": len(notes),
            "actions": self.actions,
            "parameter_changes_refused": self.refused,
            "rss_mb": self.rss,
        }


def _parser() -> argparse.ArgumentParser:
    """The soak's options: how long, which node and parameters, what memory growth fails it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    parser.add_argument("--seed", type=int, default=0, help="draws the mix of actions")
    parser.add_argument("--model-path", default="", help="model directory ('' = the embedded default model)")
    parser.add_argument("--camera-hz", type=float, default=15.0)
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a startup parameter of the node (YAML value), e.g. --param weight_quant=int4; repeatable",
    )
    parser.add_argument(
        "--managed",
        action="store_true",
        help="the lifecycle node (vlm_lifecycle_node): configured and activated, then deactivated mid-answer and "
        "activated again among the actions",
    )
    parser.add_argument("--warmup-s", type=float, help="seconds before memory must stay flat (default: a third)")
    parser.add_argument(
        "--max-growth-mb", type=float, default=64.0, help="the node's memory growth allowed after the warm-up"
    )
    parser.add_argument("--out", type=Path, help="write the summary here as JSON")
    return parser


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    startup = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep or not name:
            parser.error(f"--param {item!r}: expected NAME=VALUE")
        startup[name] = yaml.safe_load(value)

    from support.node_process import domain_id_for

    domain = int(os.environ.get("ROS_DOMAIN_ID") or domain_id_for("tools.soak"))
    workdir = Path(tempfile.mkdtemp(prefix="orin_vlm_soak_"))
    os.environ.update(ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST", ROS_DOMAIN_ID=str(domain))  # before rclpy loads
    from support.node_client import VlmClient
    from support.node_process import MANAGED, NodeProcess, installed_executable

    params = {"model_path": args.model_path, "max_new_tokens": 48, "image_max_age_s": 5.0, **startup}
    node = NodeProcess(
        params,
        workdir,
        domain,
        executable=MANAGED if args.managed else installed_executable(),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    client = VlmClient(domain)
    client.subscribe_diagnostics()
    soak = Soak(client, node, random.Random(args.seed), camera_frames(6, args.seed), managed=args.managed)
    try:
        if args.managed:
            client.wait_for(lambda: f"{client.fqn}/change_state" in dict(client.node.get_service_names_and_types()),
                            300.0, "the lifecycle services")  # fmt: skip
            assert client.change_state("configure") and client.change_state("activate"), node.output()[-3000:]
        client.wait_until_connected(node, timeout=300.0)
        client.wait_for(lambda: client.events(event="ready"), 300.0, "the ready event")
        print(f"node ready; {args.duration:.0f} s of traffic, logs in {workdir}", flush=True)
        soak.run(args.duration, args.camera_hz)
        warmup_s = args.duration / 3 if args.warmup_s is None else args.warmup_s
        problems = soak.problems(warmup_s, args.max_growth_mb, args.camera_hz)
    except AssertionError as exc:  # the client's timeouts: the node stopped answering
        problems = [f"stopped answering: {exc}"]
    finally:
        client.close()
        rc, elapsed = node.stop(timeout=10.0)
    output = node.output()
    if "Traceback" in output:
        problems.append("a traceback in the node's log")
    if rc != 0:
        problems.append(f"the node stopped with exit code {rc} (after {elapsed:.1f} s)")
    result = {**soak.summary(), "node_exit_code": rc, "problems": problems, "log_dir": str(workdir)}
    for key, value in result.items():
        print(f"{key}: {json.dumps(value)}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if problems:
        print(f"--- node output (end) ---\n{output[-4000:]}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
