"""`make demo`: start the node with the embedded default model, show it pictures, print its answers.

What it does, in the order a ROS user would: starts ``vlm_node`` (the installed entry point, else
``python -m orin_vlm_node.ros.main``) as a child in its own process group, with DDS discovery kept on
this machine, its own ROS_DOMAIN_ID and a temporary ROS_LOG_DIR; publishes a sample image
(``sensor_msgs/Image``, rgb8) and a prompt (``std_msgs/String``); prints the tokens as they stream
on ``tokens``, then the metrics from ``status``; asks one question held to a JSON schema and one detection
request, prints the detections in camera pixels and saves the node's annotated picture to a PNG file;
finally stops the node with SIGINT (SIGKILL if it does not exit in time) and exits non-zero if anything
went wrong.

Sample images come from ``support.synthetic_scenes`` and ``support.scene_formats`` (the scenes the default
model was trained on, from their held-out sets); one question is about time: a clip of
``support.scene_videos`` published frame by frame, then asked about as video.
Run from the repository root: ``python -m tools.demo``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

from support import scene_formats, scene_videos, synthetic_scenes


def samples(count: int) -> list[tuple[np.ndarray, str, str]]:
    """(RGB image, question, expected answer) for the demo: one per question type, one in Chinese."""
    chosen, seen = [], set()
    for s in synthetic_scenes.held_out_samples(60):
        key = (s.qtype, s.lang)
        if s.image is not None and key not in seen and (s.lang == "en" or len(chosen) == count - 1):
            chosen.append((s.image, s.question, s.answer))
            seen.add(key)
        if len(chosen) == count:
            break
    return chosen


def _show_runtime_parameters(client, sample, image_cls, to_msg) -> int:
    """What `ros2 param set` does, through the same /orin_vlm/set_parameters service: an invalid value is
    refused with a reason; paging off is applied between requests and gives the same greedy answer."""
    rgb, question, _ = sample
    (refused,) = client.set_params({"page_size": 24})
    print(f"set page_size=24 -> {'accepted' if refused.successful else 'refused: ' + refused.reason}")
    client.publish_image(to_msg(rgb, image_cls))
    before = client.ask(question, timeout=300.0)["response"]
    n = len(client.events(event="reconfigured"))
    (result,) = client.set_params({"use_paged_attention": False})
    client.wait_for(lambda: len(client.events(event="reconfigured")) > n, 120, "the node to reconfigure")
    print(f"set use_paged_attention=false -> {client.events(event='reconfigured')[-1]['changes']}")
    client.publish_image(to_msg(rgb, image_cls))
    after = client.ask(question, timeout=300.0)["response"]
    same = after == before
    print(f"same question, contiguous KV cache: {after!r} ({'same answer' if same else 'DIFFERENT answer'})")
    client.set_params({"use_paged_attention": True})
    return 0 if (result.successful and not refused.successful and same) else 1


def _ask_samples(client, count: int, image_cls, to_msg) -> int:
    """Ask ``count`` sample questions, each about its own picture (the answer streams as it comes), and print
    the expected answer and the metrics; how many did not finish."""
    failures = 0
    for i, (rgb, question, expected) in enumerate(samples(count), 1):
        msg = to_msg(rgb, image_cls)
        msg.header.stamp.sec = i
        client.publish_image(msg)
        print(f"[{i}] image {rgb.shape[1]}x{rgb.shape[0]}  prompt: {question}\n    answer: ", end="", flush=True)
        result = client.ask(question, timeout=300.0)
        status = result["status"]
        print()
        if status["event"] != "finished":
            failures += 1
            print(f"    {status['event']}: {status['error'] or status['note']}")
            continue
        if expected is not None:
            print(f"    expected: {expected}")
        m = status["metrics"]
        print(
            f"    {int(m['generated_tokens'])} tokens, finish={status['finish_reason']}, "
            f"TTFT {m['ttft_s'] * 1000:.0f} ms, prefill {m['prefill_tokens_per_s']:.0f} tok/s, "
            f"decode {m['decode_tokens_per_s']:.1f} tok/s, prompt {int(m['prompt_tokens'])} tokens\n",
            flush=True,
        )
    return failures


def _ask_about_motion(client, image_cls, to_msg) -> int:
    """A question about time: a held-out clip's frames published as a camera would (stamped 0.5 s apart), then
    a ``prompt_json`` message asking about the last seconds as video; 1 when it did not finish."""
    clip = next(c for c in scene_videos.held_out_clips(20) if c.lang == "en" and len(c.frames) >= 5)
    for i, frame in enumerate(clip.frames):
        msg = to_msg(frame, image_cls)
        msg.header.stamp.sec, msg.header.stamp.nanosec = 100 + i // 2, (i % 2) * 500_000_000
        client.publish_image(msg, repeat=1)
    time.sleep(0.3)
    message = {"prompt": clip.question, "video": clip.times[-1]}
    h, w = clip.frames[0].shape[:2]
    print(f"[video] {len(clip.frames)} frames {w}x{h}, 0.5 s apart  prompt_json: {json.dumps(message)}\n    answer: ",
          end="", flush=True)  # fmt: skip
    status = client.ask(message, timeout=300.0)["status"]
    print()
    if status["event"] != "finished":
        print(f"    {status['event']}: {status['error'] or status['note']}")
        return 1
    (video,) = status["videos"]
    sent = f"{video['frames']} frames sent (stamps {video['first_stamp']:g} to {video['last_stamp']:g} s)"
    tokens = int(status["metrics"]["video_tokens"])
    print(f"    expected: {clip.answer}\n    {sent}, {tokens} video tokens\n", flush=True)
    return 0


def _show_formats(client, image_cls, to_msg, picture: Path) -> int:
    """A question held to a JSON schema (on ``prompt_json``), then a detection request whose boxes come back in
    the camera's pixels on ``detections_json`` and drawn on ``detections_image`` (saved to ``picture``)."""
    from std_msgs.msg import String

    shapes = scene_formats.held_out_shape_lists(1)[0]
    client.publish_image(to_msg(shapes.image, image_cls))
    asked = {"prompt": shapes.question, "output": {"json_schema": scene_formats.SHAPE_LIST_SCHEMA}}
    print(f"prompt_json: {json.dumps(asked)[:120]}...\n    answer: ", end="", flush=True)
    listed = client.ask(asked, timeout=300.0)
    print(f"\n    expected: {shapes.answer}\n")
    task = next(t for t in scene_formats.held_out_grounding(20) if not t.points and len(t.truth) >= 2)
    received: dict[str, list] = {"json": [], "image": []}
    client.node.create_subscription(String, "detections_json", lambda m: received["json"].append(m.data), 10)
    client.node.create_subscription(image_cls, "detections_image", received["image"].append, 10)
    client.publish_image(to_msg(task.sample.image, image_cls, frame_id="front_camera"))
    labels = ", ".join(task.labels)
    height, width = task.sample.image.shape[:2]
    print(f"prompt_json: {json.dumps({'detect': labels})}  (image {width}x{height})\n    answer: ", end="", flush=True)
    result = client.ask({"detect": labels}, timeout=300.0)
    print()
    if result["status"]["event"] != "finished":
        print(f"    {result['status']['event']}: {result['status']['error']}")
        return 1
    client.wait_for(lambda: received["json"] and received["image"], 30, "the detections")
    for d in json.loads(received["json"][0])["detections"]:
        print(f"    {d['label']:>16}: box {[round(v) for v in d['box']]} px, score {d['score']:.2f}")
    print("    truth:  " + ", ".join(f"{label} {list(box)}" for label, box in task.truth))
    drawn = received["image"][0]
    rgb = np.frombuffer(bytes(drawn.data), np.uint8).reshape(drawn.height, drawn.step)[:, : drawn.width * 3]
    cv2.imwrite(str(picture), cv2.cvtColor(rgb.reshape(drawn.height, drawn.width, 3), cv2.COLOR_RGB2BGR))
    print(f"    annotated picture ({drawn.encoding}) saved to {picture}\n")
    return 0 if listed["status"]["event"] == "finished" else 1


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default="", help="model directory ('' = the embedded default model)")
    parser.add_argument("--questions", type=int, default=3, help="how many sample questions to ask")
    parser.add_argument("--max-new-tokens", type=int, default=160, help="a detection answer takes ~30 per object")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument(
        "--detections-picture",
        type=Path,
        default=Path(tempfile.gettempdir()) / "orin_vlm_demo_detections.png",
        help="where the annotated picture of the detection request is saved",
    )
    return parser.parse_args()


def main() -> int:
    args = _arguments()
    # This process joins the node's private domain on localhost only; set before rclpy is imported.
    from support.node_process import domain_id_for

    domain = domain_id_for("tools.demo")
    workdir = Path(tempfile.mkdtemp(prefix="orin_vlm_demo_"))
    os.environ.update(
        ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST", ROS_DOMAIN_ID=str(domain), ROS_LOG_DIR=str(workdir / "ros_log")
    )
    from sensor_msgs.msg import Image

    from orin_vlm_node.ros.image import rgb_to_image_msg
    from support.node_client import VlmClient
    from support.node_process import NodeProcess, installed_executable

    installed = installed_executable()
    params = dict(model_path=args.model_path, max_new_tokens=args.max_new_tokens, temperature=0.0)
    params["detections_image"] = True  # the annotated picture the demo saves
    print(
        f"starting the node ({installed or 'python -m orin_vlm_node.ros.main'}), "
        f"ROS_DOMAIN_ID={domain}, localhost discovery, logs in {workdir}",
        flush=True,
    )
    t0 = time.monotonic()
    node = NodeProcess(params, workdir, domain, executable=installed)
    client = None
    failures = 0
    try:
        streaming = {"echo": True}  # print tokens as they arrive while asking the sample questions
        client = VlmClient(domain, on_token=lambda text: streaming["echo"] and print(text, end="", flush=True))
        client.wait_until_connected(node, timeout=args.startup_timeout)
        print(f"node ready after {time.monotonic() - t0:.1f} s\n", flush=True)
        failures += _ask_samples(client, args.questions, Image, rgb_to_image_msg)
        failures += _ask_about_motion(client, Image, rgb_to_image_msg)
        failures += _show_formats(client, Image, rgb_to_image_msg, args.detections_picture)
        streaming["echo"] = False
        failures += _show_runtime_parameters(client, samples(1)[0], Image, rgb_to_image_msg)
    except AssertionError as exc:  # the client's timeouts
        failures += 1
        print(f"\ndemo failed: {exc}\n--- node output ---\n{node.output()[-4000:]}", file=sys.stderr)
    finally:
        if client is not None:
            client.close()
        rc, elapsed = node.stop(timeout=10.0)
        how = f"exit code {rc}" if rc is not None else "killed after not exiting in 10 s"
        print(f"node stopped with SIGINT in {elapsed:.2f} s ({how})")
        if rc != 0:
            failures += 1
            print(node.output()[-4000:], file=sys.stderr)
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
