"""Through the node with ``backend`` openai against a direct streaming client of the same vLLM, in one run:
what the node adds to a remote server's answers (tokens/s a ROS subscriber sees, time to the first token).

The server is a real vLLM serving the default model on this machine's CPU (``support.vllm_server``; the
section is skipped without its environment: ``make vllm-env``). Both sides send the same request (the body
``RemoteEngine`` builds: the same frame encoded the same way, the same output format) and are timed the
same way, from the request (prompt published / connection opened) to the first and last text. The answer is
held to a regular expression of ``remote_chars`` letters so it is long (per-token costs are what the node
adds to) and the same on both sides whatever the model would have said. Pairs alternate. The frame's
encoding, which the node does and a direct client given an encoded frame does not, is timed apart.
"""

from __future__ import annotations

import time

from bench.context import BenchContext
from bench.section import SectionResult, skipped
from bench.stats import alternate, paired_ratio

PROMPT = "Describe the picture in one sentence."


def run(ctx: BenchContext) -> SectionResult:
    cfg = ctx.config
    try:
        import rclpy  # noqa: F401

        from support.node_process import NodeProcess, domain_id_for
        from support.vllm_server import SERVED_NAME, VllmServer, env_python, free_port
    except ImportError as exc:
        return skipped("remote", f"rclpy or the node's process helpers not importable: {exc}")
    if not cfg.remote:
        return skipped("remote", f"disabled in {cfg.mode} mode (starting vLLM takes a minute or more)")
    python = env_python()
    if python is None:
        return skipped("remote", "no vLLM environment on this machine (make vllm-env)")
    server = VllmServer(python, free_port(), log=ctx.scratch / "vllm.log")
    node = None
    try:
        server.wait_ready()
        domain = domain_id_for("bench.remote_overhead")
        params = {"backend": "openai", "remote_url": server.url, "remote_model": SERVED_NAME, "temperature": 0.0,
                  "max_new_tokens": cfg.remote_chars + 8, "multi_turn": False, "image_max_age_s": 3600.0}  # fmt: skip
        node = NodeProcess(params, ctx.scratch / "remote_node", domain)
        res = SectionResult("remote")
        res.setup.update(server="vLLM 0.32 (CPU) serving the default model", answer_chars=cfg.remote_chars,
                         pairs=cfg.remote_repeats, image_hw=list(cfg.image_size), domain_id=domain)  # fmt: skip
        _measure(ctx, res, server.url, SERVED_NAME, node, domain)
        return res
    finally:
        if node is not None:
            node.stop(timeout=20.0)
        server.stop()


def _measure(ctx: BenchContext, res: SectionResult, url: str, model: str, node, domain: int) -> None:
    from sensor_msgs.msg import Image

    from orin_vlm_node.engine import Request, SamplingParams, Turn, output_format
    from orin_vlm_node.remote.client import ChatStream, Endpoint
    from orin_vlm_node.remote.messages import Conversation, data_url, request_body, user_message
    from orin_vlm_node.ros.image import rgb_to_image_msg
    from support.node_client import VlmClient

    cfg = ctx.config
    image = ctx.image(*cfg.image_size, seed=3)
    regex = f"[ab]{{{cfg.remote_chars}}}"
    arrivals: list[tuple[float, str]] = []
    inside: list[float] = []  # the node's own view of each answer's TTFT: queue wait + request to first text
    client = VlmClient(domain, on_token=lambda text: arrivals.append((time.perf_counter(), text)))
    try:
        client.wait_until_connected(node, timeout=120.0)
        client.publish_image(rgb_to_image_msg(image, Image))
        request = Request(Turn(PROMPT, (image,)), SamplingParams(temperature=0.0, max_new_tokens=cfg.remote_chars + 8),
                          output=output_format("regex", regex))  # fmt: skip
        body = request_body(model, request, Conversation().with_turn(None, user_message(request.turn, "jpeg")),
                            SamplingParams())  # fmt: skip

        def direct() -> tuple[float, float, float]:
            t0, times, tokens = time.perf_counter(), [], 0.0
            for chunk in ChatStream(Endpoint(url, timeout_s=60.0), body):
                tokens = float((chunk.get("usage") or {}).get("completion_tokens", tokens))
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                    times.append(time.perf_counter())
            return times[0] - t0, times[-1] - times[0], tokens

        def through_node() -> tuple[float, float, float]:
            n = len(arrivals)
            t0 = time.perf_counter()
            out = client.ask({"prompt": PROMPT, "output": {"regex": regex}}, timeout=300.0)
            if out["status"]["event"] != "finished":
                raise RuntimeError(f"node answered {out['status']}")
            times, metrics = [t for t, text in arrivals[n:] if text], out["status"]["metrics"]
            inside.append(metrics["queue_wait_s"] + metrics["ttft_s"])
            return times[0] - t0, times[-1] - times[0], float(metrics["generated_tokens"])

        runs = alternate({"direct": direct, "node": through_node}, repeats=cfg.remote_repeats, warmup=cfg.warmup)
    finally:
        client.close()
    _figures(res, runs, [_encode_ms(data_url, image) for _ in range(cfg.remote_repeats)])
    res.add("ttft_ms.node_inside", "ms", [t * 1000 for t in inside[-cfg.remote_repeats :]],
            "the node's own: prompt taken -> first text from the server (its status metrics)")  # fmt: skip


def _encode_ms(data_url, image) -> float:
    t0 = time.perf_counter()
    data_url(image, "rgb", "jpeg")
    return (time.perf_counter() - t0) * 1000


def _figures(res: SectionResult, runs: dict[str, list[tuple[float, float, float]]], encode_ms: list[float]) -> None:
    rates = {side: [(n - 1) / span for _, span, n in runs[side]] for side in runs}
    ttft_ms = {side: [t * 1000 for t, _, _ in runs[side]] for side in runs}
    res.add("decode_tokens_per_s.direct", "tokens/s", rates["direct"], "a streaming client of vLLM, first to last text")
    res.add("decode_tokens_per_s.node", "tokens/s", rates["node"], "a ROS subscriber of the node's tokens, same span")
    res.add("decode_ratio", "x", paired_ratio(rates["node"], rates["direct"]), "node / direct, per pair")
    res.add("ttft_ms.direct", "ms", ttft_ms["direct"], "request sent -> first text (frame already encoded)")
    res.add("ttft_ms.node", "ms", ttft_ms["node"], "prompt published -> first tokens message")
    added = [n - d for n, d in zip(ttft_ms["node"], ttft_ms["direct"], strict=True)]
    res.add("ttft_added_ms", "ms", added, "node TTFT - direct TTFT, per pair")
    res.add("image_encode_ms", "ms", encode_ms, "the frame as a JPEG data URL (the node's part of the added TTFT)")
    res.add("ttft_added_beyond_encoding_ms", "ms", [a - e for a, e in zip(added, encode_ms, strict=True)],
            "added TTFT less the frame's encoding")  # fmt: skip
