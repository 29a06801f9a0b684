"""What the steps of ``make gpu-check`` share: where things are, what was found, the log, and how every step runs a
child process (its output into the log, a failure as ``StepFailed`` with the output's tail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


class StepFailed(RuntimeError):
    """A step did not pass; the message is what the report shows."""


@dataclass
class Check:
    """State shared by the steps: where things are, what was found, the log."""

    wheels: Path
    out: Path
    work: Path
    budget_s: float
    log_file: Any
    started: float = field(default_factory=time.monotonic)
    bench_parts: str = ""  # the bench step's GPU parts (bench.run --gpu-parts; empty: all)
    pythonpath: list[str] = field(default_factory=list)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def log(self, text: str) -> None:
        line = f"[gpu-check {time.monotonic() - self.started:6.1f}s] {text}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def env(self) -> dict[str, str]:
        """Environment of every child: the private packages first, this checkout, a shared kernel cache."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*self.pythonpath, str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        env["XDG_CACHE_HOME"] = str(self.work / "cache")
        env["PYTHONUNBUFFERED"] = "1"
        env["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
        return env

    def run(self, cmd: Sequence[str], timeout_s: float, cwd: Path = REPO) -> str:
        """Run a child, its output into the log; StepFailed (with the output's tail) when it fails."""
        self.log("$ " + " ".join(cmd))
        try:
            proc = subprocess.run(
                list(cmd), cwd=cwd, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                timeout=timeout_s,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            self.log_file.write((exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else "")
            raise StepFailed(f"{cmd[0]} ... timed out after {timeout_s:.0f} s") from exc
        self.log_file.write(proc.stdout)
        self.log_file.flush()
        if proc.returncode:
            tail = "\n".join(line[:300] for line in proc.stdout.strip().splitlines()[-12:])
            raise StepFailed(f"exit status {proc.returncode}:\n{tail}")
        return proc.stdout

    def python(self, code: str, timeout_s: float = 600) -> Any:
        """Run ``code`` in a child python; it must print one JSON document last."""
        return json.loads(self.run([sys.executable, "-c", code], timeout_s).strip().splitlines()[-1])
