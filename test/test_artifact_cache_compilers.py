"""A compile the node abandons stops entirely: the compiler and every process it spawned are killed, its
temporary folder removed, and parallel builds neither wait for the running compiles nor start the others; a node
killed outright (SIGKILL: no code of it runs) leaves no compiler running either.

The stand-in compiler is a shell that starts a long ``sleep`` (as nvcc starts cicc and ptxas, g++ cc1plus)
and waits for it, so a kill that reached the shell alone would leave the ``sleep`` running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from orin_vlm_node import artifact_cache as A
from support.node_process import process_running


class CompileFailed(RuntimeError):
    pass


class Stop(BaseException):
    """What the node's stop signal raises in its main thread while it starts (``ros.main.StopRequested``)."""


@pytest.fixture
def stop_signal():
    """SIGUSR1 raises :class:`Stop` in the main thread; ``stop_signal(path, ...)`` sends it to the main thread
    (interrupting the system call it waits in, as a real signal does) once every ``path`` has appeared."""
    main = threading.main_thread().ident

    def handler(signum, frame):
        raise Stop

    previous = signal.signal(signal.SIGUSR1, handler)

    def send_after(*paths: Path) -> None:
        def run() -> None:
            for path in paths:
                wait_for(path)
            signal.pthread_kill(main, signal.SIGUSR1)

        threading.Thread(target=run, daemon=True).start()

    yield send_after
    signal.signal(signal.SIGUSR1, previous)


# A compiler that records its output path, starts a child, records the child's pid and waits for it (a minute).
SLOW_COMPILER = 'echo "$0" > {out}; sleep 60 & echo $! > {child}; wait'


def compile_slowly(tmp_path: Path, name: str) -> bytes:
    script = SLOW_COMPILER.format(out=tmp_path / f"{name}.out", child=tmp_path / f"{name}.child")
    return A.run_compiler(lambda out: ["sh", "-c", script, str(out)], "out.bin", name, CompileFailed, 120)


def wait_for(path: Path, timeout: float = 10) -> None:
    end = time.monotonic() + timeout
    while not path.exists() or not path.read_text().strip():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.02)


def ended(tmp_path: Path, name: str) -> bool:
    """The compile ``name`` left nothing: its child process and its temporary folder are gone."""
    folder = Path((tmp_path / f"{name}.out").read_text().strip()).parent
    return not process_running(int((tmp_path / f"{name}.child").read_text())) and not folder.exists()


pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")


def test_stop_compilers_kills_a_compile_running_on_another_thread_with_all_it_started(tmp_path):
    errors: list[BaseException] = []

    def build() -> None:
        try:
            compile_slowly(tmp_path, "a")
        except CompileFailed as exc:
            errors.append(exc)

    worker = threading.Thread(target=build)
    worker.start()
    wait_for(tmp_path / "a.child")
    assert A.stop_compilers() == 1
    worker.join(10)
    assert not worker.is_alive() and len(errors) == 1 and "could not compile a" in str(errors[0])
    assert ended(tmp_path, "a") and A.stop_compilers() == 0


def test_an_interrupted_wait_kills_the_compile_and_goes_on(tmp_path, stop_signal):
    """Ctrl-C (or the node's stop signal) in the thread that waits for the compiler."""
    stop_signal(tmp_path / "b.child")
    t0 = time.monotonic()
    with pytest.raises(Stop):
        compile_slowly(tmp_path, "b")
    assert time.monotonic() - t0 < 10 and ended(tmp_path, "b")


def test_interrupted_parallel_builds_stop_at_once_and_start_no_more(tmp_path, stop_signal):
    names = ["c0", "c1", "c2", "c3"]
    stop_signal(tmp_path / "c0.child", tmp_path / "c1.child")
    t0 = time.monotonic()
    with pytest.raises(Stop):
        A.in_parallel(lambda name: compile_slowly(tmp_path, name), names, 2)
    assert time.monotonic() - t0 < 10
    deadline = time.monotonic() + 10  # killed at once; reaped and cleaned up within moments on a loaded machine
    while not (ended(tmp_path, "c0") and ended(tmp_path, "c1")):
        assert time.monotonic() < deadline, "the interrupted compiles left a process or a folder"
        time.sleep(0.05)
    time.sleep(0.5)  # a job started after the interruption would have written its files by now
    assert not (tmp_path / "c2.child").exists() and not (tmp_path / "c3.child").exists()


def test_parallel_builds_give_results_in_order_and_a_failure_after_the_others_finished(tmp_path):
    def job(i: int) -> int:
        if i == 1:
            raise CompileFailed("module 1")
        time.sleep(0.2)
        (tmp_path / f"done{i}").touch()
        return i

    assert A.in_parallel(lambda i: i * i, range(5), 2) == [0, 1, 4, 9, 16]
    with pytest.raises(CompileFailed, match="module 1"):
        A.in_parallel(job, [0, 1, 2, 3], 2)
    assert sorted(p.name for p in tmp_path.glob("done*")) == ["done0", "done2", "done3"]


def kill_a_compiling_node(tmp_path: Path, name: str, compiler: str, ready: Callable[[], bool]) -> bool:
    """A process (the node) compiles with the stand-in ``compiler`` (a template of ``out`` and ``child``) on a
    worker thread, as the node loads its model, and is killed with SIGKILL (the OOM killer, a launch file's
    escalation) once its compiler started its child and ``ready()``: whether the compile then ``ended`` within
    10 s."""
    node = f"""
import sys, threading
sys.path[:] = {sys.path!r}
from orin_vlm_node import artifact_cache
script = {compiler.format(out=tmp_path / f"{name}.out", child=tmp_path / f"{name}.child")!r}
argv = lambda out: ["sh", "-c", script, str(out)]
threading.Thread(target=artifact_cache.run_compiler, args=(argv, "out.bin", {name!r}, RuntimeError, 120)).start()
"""
    proc = subprocess.Popen([sys.executable, "-c", node])
    try:
        wait_for(tmp_path / f"{name}.child", 30)
        end = time.monotonic() + 10
        while not ready() and time.monotonic() < end:
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait()
    end = time.monotonic() + 10
    while not ended(tmp_path, name) and time.monotonic() < end:
        time.sleep(0.05)
    return ended(tmp_path, name)


def test_a_node_killed_outright_leaves_no_compiler_running(tmp_path):
    """The compiler's group and its build folder go with a node killed outright, within a moment."""
    gone = kill_a_compiling_node(tmp_path, "k", SLOW_COMPILER, lambda: True)
    assert gone, "the compiler's child, or its build folder, is left after its node was killed"


# A compiler whose child ignores SIGTERM (as one forked while the signal went out never gets it) and keeps writing
# files into the build folder (TMPDIR) as fast as it can; the compiler itself waits for it.
WRITING_COMPILER = (
    'echo "$0" > {out}; (trap "" TERM; i=0; while :; do : > "$TMPDIR/part.$i"; i=$((i+1)); done) & '
    "echo $! > {child}; wait"
)


def test_a_killed_nodes_compile_is_removed_even_while_a_straggler_writes_into_its_folder(tmp_path):
    """The guard removes the build folder only once nothing of the compile is left to write into it: a child that
    did not stop on SIGTERM and keeps creating files is killed first (before, the folder could be left behind,
    refilled between the removal and the last kill)."""

    def writing() -> bool:
        return any(Path((tmp_path / "w.out").read_text().strip()).parent.glob("part.*"))

    assert kill_a_compiling_node(tmp_path, "w", WRITING_COMPILER, writing), "the build folder or the writer is left"


def test_a_guard_whose_node_ended_while_it_started_compiles_nothing_and_removes_the_folder(tmp_path):
    """The node killed between starting the guard and the guard asking for its death signal (the guard's parent is
    then no longer the node): nothing is compiled and the build folder the node made goes too (the CI run of
    4eb34a4 found it left, empty, by a node killed in that moment)."""
    build = tmp_path / "orin_vlm_build_x"
    build.mkdir()
    marker = tmp_path / "compiled"
    not_the_parent = 1  # init: not this guard's parent, as a dead node's pid is not
    guard = [sys.executable, "-I", "-S", str(A.COMPILER_GUARD), str(not_the_parent), str(build), "touch", str(marker)]
    done = subprocess.run(guard, capture_output=True, timeout=30)
    assert done.returncode == 128 + signal.SIGTERM and not marker.exists() and not build.exists(), done.stderr


def test_stop_compilers_also_ends_a_guard_whose_start_the_stop_interrupted(tmp_path):
    """A stop signal raised in the thread that starts a compile can land inside ``subprocess.Popen`` once the
    guard runs, before the call returns: nobody holds the guard's pid then (CI met it on 7f4ae24: the guard
    was left running after its node had exited). ``stop_compilers`` finds it among this process's children and
    ends it with its compile and its build folder. Here the guard is started as run_compiler starts one, and
    the Popen dropped."""
    build = tmp_path / "orin_vlm_build_y"
    build.mkdir()
    script = SLOW_COMPILER.format(out=tmp_path / "y.out", child=tmp_path / "y.child")
    guard = [sys.executable, "-I", "-S", str(A.COMPILER_GUARD), str(os.getpid()), str(build), "sh", "-c", script, "o"]
    subprocess.Popen(guard, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(tmp_path / "y.child")
    assert A.stop_compilers() == 1
    assert not process_running(int((tmp_path / "y.child").read_text())) and not build.exists()
    assert A.stop_compilers() == 0


def test_a_compiler_that_cannot_start_is_reported_by_name(tmp_path):
    with pytest.raises(CompileFailed, match="no-such-cc failed to run for lib: no-such-cc not found"):
        A.run_compiler(lambda out: ["no-such-cc", str(out)], "out.bin", "lib", CompileFailed, 10)
    denied = tmp_path / "cc"
    denied.write_text("#!/bin/sh\n")  # not executable
    with pytest.raises(CompileFailed, match="not found or not executable"):
        A.run_compiler(lambda out: [str(denied), str(out)], "out.bin", "lib", CompileFailed, 10)
