"""``StopSignals``: how SIGINT/SIGTERM stop the node while it starts and once it serves, in a child
interpreter each (the handlers replace the process's own, which pytest's must keep).

The finalizer case is the one the node met at random while the model loaded: the garbage collector ran a
``__del__`` at the moment the signal came, Python printed the handler's exception as "Exception ignored"
with a traceback and went on starting. The stop must still happen, before the first prompt, without the
traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import os, signal, sys
from orin_vlm_node.ros.main import StopRequested, StopSignals
stop = StopSignals()
"""


def run(body: str) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_signal_while_starting_raises_stop_requested():
    proc = run("""
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                pass
            print("not stopped")
        except StopRequested as why:
            print("stopped:", why)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "stopped: SIGTERM"


def test_a_stop_swallowed_by_a_finalizer_is_raised_before_serving_without_a_traceback():
    proc = run("""
        class Finalized:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):
                    pass

        item = Finalized()
        del item
        print("startup went on; requested:", stop.requested.is_set())
        try:
            stop.serving(lambda: None)
            print("serving")
        except StopRequested as why:
            print("stopped before serving:", why)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["startup went on; requested: True", "stopped before serving: SIGINT"]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr


def test_other_unraisable_exceptions_are_still_reported():
    proc = run("""
        class Broken:
            def __del__(self):
                raise RuntimeError("finalizer failed")

        item = Broken()
        del item
        stop.serving(lambda: None)
        print("serving")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "serving"
    assert "Exception ignored" in proc.stderr and "RuntimeError: finalizer failed" in proc.stderr


def test_once_serving_a_signal_sets_the_flag_and_wakes_the_loop_from_another_thread():
    """The serving loop waits in rclpy's C wait, where no Python signal handler runs: the wake-up comes from
    the watcher thread (here the main thread's own handler may run as well while it waits)."""
    proc = run("""
        import threading
        woken, by = threading.Event(), []
        stop.serving(lambda: (by.append(threading.get_ident()), woken.set()))
        os.kill(os.getpid(), signal.SIGTERM)
        print("woken:", woken.wait(10.0), by[0] != threading.get_ident(), stop.requested.is_set(), stop.signal_name)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "woken: True True True SIGTERM"


def test_once_serving_a_signal_only_sets_the_flag():
    proc = run("""
        stop.serving(lambda: None)
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            pass
        print("requested:", stop.requested.is_set(), stop.signal_name)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "requested: True SIGINT"


# Where a stop signal can land while the node starts, as the body of the node's constructor: plain Python code;
# a ``__set_name__`` (dataclasses call it at class creation, so while a module imports; Python 3.10 and 3.11
# wrap what it raises in a RuntimeError, as CI met while ``kvcache.paged`` was imported); a library that
# raises its own error from whatever interrupted it.
STARTS = {
    "plain": """
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            pass
    """,
    "class_creation": """
        class SignalledWhenNamed:
            def __set_name__(self, owner, name):
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):
                    pass

        class Seq:
            table = SignalledWhenNamed()
    """,
    "library_wrapper": """
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
        except BaseException as exc:
            raise ValueError("the model's config could not be read") from exc
    """,
}


@pytest.mark.parametrize("where", sorted(STARTS))
def test_a_stop_while_the_node_starts_exits_0_with_one_line_wherever_it_lands(where):
    """The entry point, with the node's constructor standing for the startup: a stop is a stop however the
    code it interrupted passed it on, not a failure to start (exit 1) and not a traceback."""
    pytest.importorskip("rclpy", reason="serve() starts rclpy (the ROS 2 wheels, installed by `make test`)")
    body = textwrap.indent(textwrap.dedent(STARTS[where]), "    ")
    code = f"import os, signal\nfrom orin_vlm_node.ros import main as entry, node\n\ndef start():\n{body}\n"
    code += "    print('not stopped', flush=True)\n\nnode.VlmNode = start\nentry.main([])\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "orin_vlm: SIGINT during startup: stopped before serving"
    assert "not stopped" not in proc.stdout


def test_the_entry_module_imports_only_what_the_handlers_need():
    """A signal before the handlers are in place ends the node the default way (a KeyboardInterrupt traceback,
    or killed by SIGTERM): the entry module itself leaves everything else to be imported once they are."""
    code = "import sys\nbefore = set(sys.modules)\nimport orin_vlm_node.ros.main\n"
    code += "print(*sorted(set(sys.modules) - before))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    imported = set(proc.stdout.split())
    assert "orin_vlm_node.ros.main" in imported
    heavy = {"logging", "socket", "ctypes", "subprocess", "orin_vlm_node.artifact_cache", "rclpy", "torch"}
    assert not imported & heavy, sorted(imported & heavy)
