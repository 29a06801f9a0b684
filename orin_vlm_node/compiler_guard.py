"""Run one compiler so that it cannot outlive the node that started it.

``python -I -S compiler_guard.py <node pid> <build folder> <compiler> <args...>``, started by
``artifact_cache.run_compiler`` as the leader of a process group of its own. A node that is stopped kills that
group itself and removes the build folder; one that is killed outright (SIGKILL, the kernel's OOM killer on a
Jetson whose memory ran out, a launch file's escalation) runs no code, and its compilers (nvcc with cicc and
ptxas, g++ with cc1plus: up to a minute and a GB each) would go on with nobody to use what they build, beside
the node a respawn starts. Linux tells a process that asks (``PR_SET_PDEATHSIG``) when the thread that started
it ends, but tells that process alone, not what it spawned; so this guard asks, runs the compiler in its group
with its temporary files in the build folder (``TMPDIR``), and when told ends the group and removes the folder.

More in docs/modules.md, ``orin_vlm_node/compiler_guard.py``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def live_processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every process but the zombies, from /proc (none where there is
    none). Also what the node's ``artifact_cache`` looks through for the guards it started."""
    found = {}
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                state, parent, group = f.read().rsplit(")", 1)[1].split()[:3]  # after the command's name
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        if state != "Z":
            found[pid] = (int(parent), int(group))
    return found


def _others_in_group() -> list[int]:
    """The live processes of this guard's group but itself."""
    me = os.getpid()
    return [pid for pid, (_, group) in live_processes().items() if group == me and pid != me]


def _end_compile(build: str, compiler: int) -> None:
    """Stop the compile (its drivers remove their files on SIGTERM), kill what of the group is still there (a
    process forked while the signal went out never got it, and may write into the folder), remove the build
    folder once nothing can write into it, then kill whatever is left, this guard included."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    end = time.monotonic() + 1.0
    try:
        while os.waitpid(compiler, os.WNOHANG) == (0, 0) and time.monotonic() < end:
            time.sleep(0.01)
    except ChildProcessError:
        pass  # reaped already
    end = time.monotonic() + 2.0
    while (others := _others_in_group()) and time.monotonic() < end:
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    shutil.rmtree(build, ignore_errors=True)
    os.killpg(0, signal.SIGKILL)


def main(argv: list[str]) -> int:
    node, build, cmd = int(argv[0]), argv[1], argv[2:]
    died = []  # the death signal came before the compiler started
    signal.signal(signal.SIGTERM, lambda signum, frame: died.append(signum))
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: no death signal; a node that is stopped still kills the group
    if died or os.getppid() != node:  # the node ended while this guard started: compile nothing
        shutil.rmtree(build, ignore_errors=True)  # nobody else is left to remove the folder it made
        return 128 + signal.SIGTERM
    try:
        pid = os.posix_spawnp(cmd[0], cmd, {**os.environ, "TMPDIR": build})
    except OSError as exc:
        print(f"{cmd[0]} failed to start: {exc}", file=sys.stderr)
        return 127
    signal.signal(signal.SIGTERM, lambda signum, frame: _end_compile(build, pid))
    if died:
        _end_compile(build, pid)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
