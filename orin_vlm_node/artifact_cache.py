"""What the node compiles on the robot at startup (CUDA cubins, the CPU GEMM library): the compiler run and
the on-disk cache.

More in docs/modules.md, ``orin_vlm_node/artifact_cache.py``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from .compiler_guard import live_processes  # standard library only (the guard runs as a script too)

_log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")

# Named after the first artifacts cached (cubins); kept so that existing caches stay valid.
_MAGIC = b"ORINVLM-CUBIN-1\n"
KEEP_PER_ARTIFACT = 4  # builds (keys) of one artifact kept in the cache, most recently used first
# All entries of one cache folder: the builds in use (a few MB per module and dtype) with room for older ones.
CACHE_BUDGET_BYTES = 512 << 20
ABANDONED_TEMP_S = 3600.0  # a write takes milliseconds: its temporary file this old was left by a dead writer
_TEMP_SUFFIX = ".tmp"
# Runs each compiler, and kills it with all it spawned when the node dies without a word (see the script).
COMPILER_GUARD = Path(__file__).with_name("compiler_guard.py")


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/orin_vlm_node/kernels``, else ``~/.cache/orin_vlm_node/kernels``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(base) / "orin_vlm_node" / "kernels"


def pack(payload: bytes) -> bytes:
    """``payload`` with the header that lets :func:`unpack` verify it."""
    return _MAGIC + len(payload).to_bytes(8, "little") + hashlib.sha256(payload).digest() + payload


def unpack(blob: bytes) -> bytes | None:
    """The payload, or None if ``blob`` is not a complete, intact cache entry."""
    head = len(_MAGIC) + 8 + 32
    if len(blob) < head or not blob.startswith(_MAGIC):
        return None
    size = int.from_bytes(blob[len(_MAGIC) : len(_MAGIC) + 8], "little")
    digest = blob[len(_MAGIC) + 8 : head]
    payload = blob[head:]
    if len(payload) != size or hashlib.sha256(payload).digest() != digest:
        return None
    return payload


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=_TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_cached(path: Path) -> bytes | None:
    """A verified cache entry's payload; None when absent, unreadable or corrupt (the last two are logged,
    a corrupt file is deleted)."""
    try:
        if not path.is_file():
            return None
        payload = unpack(path.read_bytes())
    except OSError as exc:
        _log.warning("kernel cache file %s cannot be read (%s); rebuilding", path, exc)
        return None
    if payload is None:
        _log.warning("kernel cache file %s is corrupt (bad header, size or hash); rebuilding", path)
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only cache: the rebuilt artifact is simply not written back
        return None
    try:
        os.utime(path)  # used now: the builds of an artifact are pruned least recently used first
    except OSError:
        pass  # a read-only cache keeps its entries as they are
    return payload


def write_cached(path: Path, payload: bytes, siblings: str) -> None:
    """Store ``payload`` at ``path`` (atomically, with its header), then delete all but the
    ``KEEP_PER_ARTIFACT`` most recently used files of ``path``'s directory that match the glob ``siblings``
    (the other builds of the same artifact: ``gemv-sm_87-*.cubin``), and keep the folder within its budget
    (:func:`trim_folder`). A cache that cannot be written is logged and otherwise ignored: the caller has the
    payload and carries on."""
    try:
        atomic_write(path, pack(payload))
    except OSError as exc:
        _log.warning("could not write kernel cache %s (%s); continuing without caching", path, exc)
        return
    builds = []
    for entry in path.parent.glob(siblings):
        try:
            builds.append((entry.stat().st_mtime, entry))
        except OSError:
            continue  # deleted meanwhile by another process
    for _, stale in sorted(builds, reverse=True)[KEEP_PER_ARTIFACT:]:
        _remove(stale, f"older than the {KEEP_PER_ARTIFACT} kept builds")
    trim_folder(path.parent, path)


def _is_entry(path: Path) -> bool:
    """Whether ``path`` starts as this cache's entries do (a complete one or one cut short)."""
    try:
        with path.open("rb") as f:
            return f.read(len(_MAGIC)) == _MAGIC
    except OSError:
        return False


def trim_folder(folder: Path, keep: Path) -> None:
    """Delete the least recently used entries of ``folder`` beyond :data:`CACHE_BUDGET_BYTES` (never ``keep``, the entry
    just written), and the temporary files of writes older than :data:`ABANDONED_TEMP_S`. Other files, this
    cache's temporary files of writes that may still be running, and what cannot be read are left alone (an
    empty temporary file, from a writer that died before its first byte, cannot be told from another's)."""
    now = time.time()
    entries = []
    try:
        names = list(folder.iterdir())
    except OSError:
        return
    for entry in names:
        try:
            st = entry.stat()
        except OSError:
            continue  # deleted meanwhile by another process
        if not entry.is_file() or entry == keep:
            continue
        if entry.name.endswith(_TEMP_SUFFIX):
            if now - st.st_mtime > ABANDONED_TEMP_S and _is_entry(entry):
                _remove(entry, "a write that never finished")
        elif _is_entry(entry):
            entries.append((st.st_mtime, st.st_size, entry))
    try:
        used = keep.stat().st_size
    except OSError:
        used = 0  # not written (a read-only cache) or deleted meanwhile
    for _, size, entry in sorted(entries, key=lambda e: e[0], reverse=True):
        used += size
        if used > CACHE_BUDGET_BYTES:
            _remove(entry, f"least recently used beyond the folder's {CACHE_BUDGET_BYTES / 2**20:g} MiB")


def _remove(entry: Path, why: str) -> None:
    try:
        entry.unlink()
        _log.info("kernel cache: removed %s (%s)", entry, why)
    except OSError:
        pass


# The compilers this process is running, each under its guard, the leader of a process group of its own that also
# holds what the compiler spawned (nvcc's cicc and ptxas, g++'s cc1plus and ld): killing a group stops a compile
# entirely, where killing the driver alone leaves its children compiling for up to a minute after the node has gone.
_compilers: dict[subprocess.Popen, Path] = {}  # -> the temporary directory it writes into
_compilers_lock = threading.Lock()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to ``proc``'s group unless ``proc`` is known to have ended (its pid may be another's by then)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _unregistered_guards() -> dict[int, Path]:
    """The compiler guards this process started that :func:`run_compiler` holds no ``Popen`` of -> the build
    folder each was given. A stop signal raised in the thread that starts a compile can land inside
    ``subprocess.Popen`` once the guard runs and before the call returns: the guard then runs with nobody
    holding its pid, and only /proc still names it (a child of this process, the leader of its own group,
    running :data:`COMPILER_GUARD`)."""
    me, guard = os.getpid(), str(COMPILER_GUARD)
    found = {}
    for pid, (parent, group) in live_processes().items():
        if parent != me or group != pid:
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # ended meanwhile
        if len(argv) > 5 and argv[3].decode(errors="replace") == guard:  # python -I -S <guard> <pid> <folder> ...
            found[pid] = Path(argv[5].decode(errors="replace"))
    with _compilers_lock:
        held = {proc.pid for proc in _compilers}
    return {pid: folder for pid, folder in found.items() if pid not in held}


def stop_compilers() -> int:
    """Kill every compiler :func:`run_compiler` is running in this process, with what each spawned, and say how
    many: a startup abandoned by a stop signal ends the process at once, and compilers running on its worker
    threads would otherwise go on without it. Their :func:`run_compiler` calls fail. A guard whose start the
    signal interrupted (:func:`_unregistered_guards`) is killed and reaped here too."""
    with _compilers_lock:
        running = list(_compilers.items())
    for proc, _ in running:
        _kill_group(proc)
    orphans = _unregistered_guards()
    for pid in orphans:  # children of this process not yet reaped: the pid is still theirs
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc, tmp in running:  # the process is about to end: its builds' folders go now, not with the threads
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            continue
        _remove_once_gone(proc.pid, tmp)
    for pid, tmp in orphans.items():
        end = time.monotonic() + 5.0
        try:
            while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < end:
                time.sleep(0.01)
        except ChildProcessError:
            pass  # reaped by another thread meanwhile
        _remove_once_gone(pid, tmp)
    return len(running) + len(orphans)


def _remove_once_gone(group: int, folder: Path, timeout_s: float = 5.0) -> None:
    """Remove a killed compile's build folder once nothing of its process ``group`` is left to write into it (a
    SIGKILL takes effect in a moment, not at once), or after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while any(g == group for _, g in live_processes().values()) and time.monotonic() < end:
        time.sleep(0.01)
    shutil.rmtree(folder, ignore_errors=True)


def run_compiler(
    argv: Callable[[Path], list[str]], output: str, what: str, error: type[Exception], timeout_s: float
) -> bytes:
    """The bytes of ``output`` written by the compiler command ``argv(path)`` in a temporary directory (no
    cache); ``error`` naming ``what``, with the command and the compiler's own messages, when it cannot run
    or fails. The compiler runs in a process group of its own, killed with all it spawned when the wait for
    it is interrupted (Ctrl-C, a stop signal raised in this thread), times out, or :func:`stop_compilers`, and
    by :data:`COMPILER_GUARD` when this process is killed (nothing of it runs then)."""
    with tempfile.TemporaryDirectory(prefix="orin_vlm_build_", ignore_cleanup_errors=True) as tmp:
        out = Path(tmp) / output
        cmd = argv(out)
        if shutil.which(cmd[0]) is None:
            raise error(f"{Path(cmd[0]).name} failed to run for {what}: {cmd[0]} not found or not executable")
        guarded = [sys.executable, "-I", "-S", str(COMPILER_GUARD), str(os.getpid()), tmp, *cmd]
        try:
            proc = subprocess.Popen(guarded, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)  # fmt: skip
        except OSError as exc:
            raise error(f"{Path(cmd[0]).name} failed to run for {what}: {exc}") from exc
        with _compilers_lock:
            _compilers[proc] = Path(tmp)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except BaseException as exc:
            _kill_group(proc)
            proc.communicate()  # reaped, its pipes closed: nothing of the group is left
            if isinstance(exc, subprocess.TimeoutExpired):
                raise error(f"{Path(cmd[0]).name} failed to run for {what}: {exc}") from exc
            raise
        finally:
            with _compilers_lock:
                _compilers.pop(proc, None)
        if proc.returncode or not out.is_file():
            log = (stderr + stdout).strip()
            raise error(f"{Path(cmd[0]).name} could not compile {what}:\n$ {' '.join(cmd)}\n{log}")
        return out.read_bytes()


def in_parallel(fn: Callable[[T], R], jobs: Sequence[T], workers: int) -> list[R]:
    """``fn`` of each job on ``workers`` threads, the results in job order. Interrupted (Ctrl-C or a stop signal
    raised in the calling thread), it neither waits for the running builds nor starts the others: the
    compilers are killed (:func:`stop_compilers`) and the interruption goes on, where a thread pool's own exit
    would wait for every queued compile first (a minute of nvcc at a cold start)."""
    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    try:
        results = list(pool.map(fn, jobs))
    except Exception:
        pool.shutdown(wait=True)  # one build failed: the others finish (and are cached) as they would have
        raise
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        stop_compilers()
        raise
    pool.shutdown(wait=True)
    return results


def cache_writable(cache_dir: Path) -> str | None:
    """None when artifacts can be written to ``cache_dir`` (created if needed), else the reason they cannot."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=cache_dir, prefix=".probe.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
