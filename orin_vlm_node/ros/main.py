"""Entry point of ``vlm_node`` (``python -m orin_vlm_node.ros.main``): signal handling first, then the node.

Why a module of its own: SIGINT or SIGTERM can come at any moment, also while torch and rclpy are
being imported or the model is loading (seconds on a Jetson). The handlers are installed here, before
any of that is imported, so every stop takes one of two clean paths and exits 0 with one log line:

* during startup the signal raises :class:`StopRequested` in the main thread, which abandons the load;
* once the node serves, the signal sets a flag and wakes the spin loop (a guard condition), which ends and
  shuts the node down in order (``VlmNode.shutdown``: no new prompts, the running one cancelled, a
  terminal event for every prompt, publishers flushed), while the ROS context is still valid to publish.

More in docs/modules.md, ``orin_vlm_node/ros/main.py``.
"""

from __future__ import annotations

# Only what the handlers need is imported with this module: a signal that comes before :class:`StopSignals`
# is in place ends the process the default way (SIGINT: a KeyboardInterrupt traceback; SIGTERM: killed), and
# the interpreter's own start already takes a tenth of a second with the ROS wheels' site hook. Everything
# else is imported where it is used, once the handlers are installed (logging, socket and ctypes alone took
# 15 ms, the artifact cache 12 ms more).
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

from .names import NODE_NAME

if TYPE_CHECKING:
    import socket
    from collections.abc import Callable
    from typing import Any

STOP_WITH_PARENT = "--stop-with-parent"  # the one option of the entry points besides the ROS arguments
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class StopRequested(BaseException):
    """SIGINT/SIGTERM while the node was starting (a BaseException, so no ``except Exception`` in a
    library swallows it)."""


def stop_behind(exc: BaseException) -> StopRequested | None:
    """The :class:`StopRequested` that ``exc`` is, or was raised from or while handling; else None.

    Why: the signal's exception surfaces wherever the main thread is, and some code there wraps what it
    raises. Python 3.10 and 3.11 wrap an exception out of ``__set_name__`` (which ``dataclasses`` calls
    at class creation, so at import) in a ``RuntimeError``; a library's ``except BaseException`` may
    raise its own error from it. Such a stop is still a stop, not a failure to start.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, StopRequested):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


class StopSignals:
    """SIGINT and SIGTERM as a stop request: raised while starting, a flag once :meth:`serving`.

    A signal handler's exception surfaces wherever the main thread happens to be. When that is a finalizer
    (``__del__``, a weakref callback: the garbage collector runs them at any allocation while torch and the
    model load), Python cannot raise it and prints it as "Exception ignored" with a traceback, and the
    startup goes on. Such a stop is not lost: its flag is set, the print is suppressed, and
    :meth:`serving` raises it before the node takes its first prompt.
    """

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.signal_name = ""
        self._serving = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        self._unraisable_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable

    def serving(self, wake: Callable[[], None]) -> None:
        """From now on a signal sets :attr:`requested` and calls ``wake`` (the serving loop's guard condition)
        from a watcher thread, as the main thread may be waiting in C where no Python signal handler runs; a
        stop that arrived while starting and was swallowed (see the class) is raised here."""
        import socket

        if self.requested.is_set():
            raise StopRequested(self.signal_name)
        self._serving = True
        self._wakeup = socket.socketpair()  # kept open for the process's life, like the handlers
        reader, writer = self._wakeup
        writer.setblocking(False)  # Python's C-level handler writes the signal number there at once
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(reader, wake), name="orin_vlm_signals", daemon=True).start()

    def _watch(self, reader: socket.socket, wake: Callable[[], None]) -> None:
        from ..artifact_cache import stop_compilers

        stops = (signal.SIGINT, signal.SIGTERM)
        while data := reader.recv(16):
            for signum in (s for s in data if s in stops):
                self.signal_name = signal.Signals(signum).name
                self.requested.set()
                # A build running now (the managed node's configure loads the model in a callback; a reconfiguration
                # to another kernel cache) would hold the stop up for as long as nvcc takes: it fails instead.
                stop_compilers()
                wake()

    def _unraisable(self, unraisable: Any) -> None:
        if stop_behind(unraisable.exc_value) is None:
            self._unraisable_hook(unraisable)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name
        first = not self.requested.is_set()
        self.requested.set()
        if first and not self._serving:
            raise StopRequested(self.signal_name)


def serve(stop: StopSignals, args: list[str] | None = None, managed: bool = False) -> int:
    """Start the node and serve until ``stop`` is requested, ROS shuts down or the node is done (a managed
    node after its ``shutdown`` transition); 1 when it cannot start (the reason is logged). Signals are
    ``stop``'s, not rclpy's. torch and rclpy are imported here, under ``stop``'s handlers. ``managed``: the
    lifecycle node, which loads nothing until it is configured."""
    import rclpy
    from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
    from rclpy.signals import SignalHandlerOptions

    from ..engine import EngineError
    from .node import VlmNode
    from .startup import StartupError

    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    try:
        if managed:
            from .lifecycle_node import VlmLifecycleNode

            node = VlmLifecycleNode()
        else:
            node = VlmNode()
    except BaseException as exc:
        if stop_behind(exc) is None and isinstance(exc, (StartupError, EngineError, ValueError)):
            message = str(exc) if isinstance(exc, EngineError) else f"cannot start: {exc}"
            rclpy.logging.get_logger(NODE_NAME).fatal(message)
            rclpy.try_shutdown()
            return 1
        rclpy.try_shutdown()
        raise
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    stop.serving(node.create_guard_condition(lambda: None).trigger)
    try:
        while not stop.requested.is_set() and rclpy.ok() and not node.finished:
            executor.spin_once()  # until a callback ran (a stop signal triggers the guard condition)
    except ExternalShutdownException:
        pass
    if not node.finished:
        why = f"{stop.signal_name} received" if stop.signal_name else "ROS shut down"
        node.get_logger().info(f"shutting down ({why})")
        node.shutdown(f"node shutting down ({why})")
    executor.shutdown(timeout_sec=1.0)
    node.destroy_node()
    rclpy.try_shutdown()
    return 0


def stop_with_parent() -> None:
    """Have the kernel send this process SIGTERM (a stop request, see :class:`StopSignals`) when its parent
    exits. Linux only; elsewhere, or when the kernel refuses, a line says so and the node runs on.

    Why: ``ros2 launch`` stopped by SIGTERM exits at once and leaves the processes it started running
    (upstream launch's documented behaviour), and an orphaned node keeps its model in the robot's memory
    while the launch a supervisor starts next loads a second one beside it. The launch file passes
    ``--stop-with-parent``; a node started by hand (``ros2 run``, ``nohup``) keeps running on its own.
    The request survives the ROS wheels' re-exec of the interpreter (same process, no set-user-ID binary).
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    if libc is None or libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        why = os.strerror(ctypes.get_errno()) if libc is not None else f"not on Linux ({sys.platform})"
        print(f"{NODE_NAME}: {STOP_WITH_PARENT} ignored: {why}", file=sys.stderr, flush=True)
        return
    if os.getppid() == 1:  # the parent exited before the request was in place: nobody will signal
        os.kill(os.getpid(), signal.SIGTERM)


def own_arguments(argv: list[str]) -> list[str]:
    """The command line's arguments outside its ROS arguments (each ``--ros-args`` up to ``--`` or the end).

    Why they are checked at all: rclpy leaves what it does not know to the program, so a typo such as
    ``--ros-arg -p model_path:=...`` would otherwise start the node on the default model without a word.
    """
    own, in_ros = [], False
    for arg in argv:
        if arg == "--ros-args":
            in_ros = True
        elif in_ros and arg == "--":
            in_ros = False
        elif not in_ros:
            own.append(arg)
    return own


def main(args: list[str] | None = None, managed: bool = False) -> int:
    """Run the node; the exit status is 0 after a stop by signal or ROS shutdown, 1 when it cannot start.

    ``args``: the command line after the program name (default ``sys.argv[1:]``): the ROS arguments, and
    before them :data:`STOP_WITH_PARENT` (see :func:`stop_with_parent`).

    The process ends with ``os._exit`` once output is flushed: the interpreter's own teardown of torch
    takes seconds on a loaded Jetson, and ``ros2 launch`` escalates to SIGKILL when a node lingers.
    """
    stop = StopSignals()  # first of all (see the imports at the top)
    try:
        own = own_arguments(sys.argv[1:] if args is None else args)
        unknown = [arg for arg in own if arg != STOP_WITH_PARENT]
        if unknown:
            print(f"{NODE_NAME}: cannot start: unknown argument(s) {' '.join(unknown)}; the node takes "
                  f"{STOP_WITH_PARENT} and ROS arguments after --ros-args (e.g. --ros-args -p model_path:=<dir>)",
                  file=sys.stderr, flush=True)  # fmt: skip
            return 1
        if STOP_WITH_PARENT in own:
            stop_with_parent()
        code = serve(stop, args, managed)
    except BaseException as exc:
        why = stop_behind(exc)
        if why is None:
            raise
        from ..artifact_cache import stop_compilers

        stopped = stop_compilers()  # the load thread's kernel builds would go on without the process
        builds = f" ({stopped} kernel build(s) stopped)" if stopped else ""
        print(f"{NODE_NAME}: {why} during startup: stopped before serving{builds}", file=sys.stderr, flush=True)
        code = 0
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main_lifecycle(args: list[str] | None = None) -> int:
    """``vlm_lifecycle_node``: the managed node (``configure`` loads the model, ``activate`` serves)."""
    return main(args, managed=True)


if __name__ == "__main__":
    sys.exit(main())
