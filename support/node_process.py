"""Run the node as a child process the way tests, the demo and benchmarks need it.

Why this is more than ``subprocess.Popen``: the ROS wheels re-exec the interpreter once at startup
and a node must be stoppable like ``ros2 launch`` stops it. So the node gets its own process group
and is stopped with SIGINT to the whole group (rclpy installs its SIGINT handler even where a
background shell left SIGINT ignored), a timeout and a SIGKILL fallback. Its environment always
keeps DDS discovery on this machine (``ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST``), uses the given
``ROS_DOMAIN_ID`` and writes ROS logs to a private directory.

No rclpy import here: the parent may not use ROS at all.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def ros_env(domain_id: int, log_dir: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a ROS child: localhost discovery, its domain, private logs and, when this
    package runs from a source checkout, that checkout first on PYTHONPATH (the child must run the same
    orin_vlm_node as the parent)."""
    env = dict(os.environ if base is None else base)
    env.update(
        ROS_DOMAIN_ID=str(domain_id),
        ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST",
        ROS_LOG_DIR=str(log_dir),
        PYTHONUNBUFFERED="1",
    )
    if (PACKAGE_ROOT / "setup.py").is_file():  # a source checkout, not site-packages
        env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def domain_id_for(salt: str) -> int:
    """A ROS_DOMAIN_ID in 1..101 for this process and ``salt`` (who asks: a test module, the demo, a benchmark),
    never 42 or 77 (the defaults of conftest and the Makefile, which other runs on this machine may use), so
    concurrent runs on one machine do not hear each other. Ids above 101 collide with Linux's ephemeral ports.

    Where the suite runs in parallel (pytest-xdist sets ``PYTEST_XDIST_WORKER`` = ``gw<i>`` and the worker
    count), worker i takes only ids congruent to i modulo the count: modules that run at the same time in
    different workers then never share a domain, whatever their process ids."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    ids = [i for i in range(1, 102) if i not in (42, 77) and i % workers == worker % workers]
    return ids[(os.getpid() * 7 + zlib.crc32(salt.encode())) % len(ids)]


def installed_executable() -> str | None:
    """This interpreter's installed ``vlm_node`` entry point (what a user runs), or None where the package is
    not installed (then :func:`node_command` runs ``python -m orin_vlm_node.ros.main``)."""
    path = Path(sys.executable).with_name("vlm_node")
    return str(path) if path.exists() else None


MANAGED = "managed"  # ``executable`` for the lifecycle node of this interpreter's orin_vlm_node


def node_command(executable: str | None = None) -> list[str]:
    """``[vlm_node]`` when an installed entry point is given, the lifecycle node's main for :data:`MANAGED`,
    else ``python -m orin_vlm_node.ros.main``."""
    if executable == MANAGED:
        return [sys.executable, "-c", "import sys; from orin_vlm_node.ros.main import main_lifecycle; "
                "sys.exit(main_lifecycle())"]  # fmt: skip
    return [executable] if executable else [sys.executable, "-m", "orin_vlm_node.ros.main"]


class NodeProcess:
    """The node in its own process group, parameters from a YAML file, stdout+stderr to a file."""

    def __init__(
        self,
        params: Mapping[str, Any],
        workdir: Path,
        domain_id: int,
        extra_args: list[str] | None = None,
        executable: str | None = None,
        env: Mapping[str, str] | None = None,
    ):
        workdir.mkdir(parents=True, exist_ok=True)
        self.params_file = workdir / "params.yaml"
        self.params_file.write_text(yaml.safe_dump({"/**": {"ros__parameters": dict(params)}}))
        ros_args = ["--ros-args", "--params-file", str(self.params_file)] if params else ["--ros-args"]
        self.log_path = workdir / "node_output.txt"
        self.domain_id = domain_id
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            node_command(executable) + ros_args + (extra_args or []),
            env=ros_env(domain_id, workdir / "ros_log", env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # own process group: signals reach the re-exec'd interpreter too
        )

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 10.0) -> tuple[int | None, float]:
        """SIGINT to the group, wait ``timeout``, then SIGKILL. Returns (exit code, seconds to exit);
        exit code None means it had to be killed."""
        t0 = time.monotonic()
        rc: int | None = self.proc.poll()
        if rc is None:
            self.signal_group(signal.SIGINT)
            rc = self.wait(timeout)
            if rc is None:
                self.signal_group(signal.SIGKILL)
                self.proc.wait(timeout=10)
        elapsed = time.monotonic() - t0
        self._log.close()
        return rc, elapsed


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, parent pid, group, session, ...), or
    None when the process has ended."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_running(pid: int) -> bool:
    """The process exists and has not exited (a zombie counts as exited: an orphan's reaper may be slow)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def processes() -> list[tuple[int, int, int, str]]:
    """(pid, parent pid, session id, command line) of every running process (Linux ``/proc``; zombies left
    out): what a test looks through for the compilers a node started, or left behind."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _stat(entry.name)
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # ended meanwhile
        if fields is not None and fields[0] != "Z":
            found.append((int(entry.name), int(fields[1]), int(fields[3]), cmdline))
    return found


def compiler_of(node: NodeProcess, source: str, timeout: float = 60.0) -> int | None:
    """The pid of the compiler ``node`` runs on ``source`` (a child of its process, ``source`` in its command
    line), once it runs; None when the node ends or ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while node.alive() and time.monotonic() < deadline:
        pid = next((pid for pid, parent, _, cmd in processes() if parent == node.proc.pid and source in cmd), None)
        if pid is not None:
            return pid
        time.sleep(0.02)
    return None
