"""Load the cubins into torch's CUDA context and launch kernels on torch's current stream.

Context: torch works in the device's *primary* context. PyCUDA retains that same context
(``Device.retain_primary_context()``) and pushes it on any thread that launches while it is not current
(a context is current per thread; the engine may run on a worker thread). Tensors' ``data_ptr()`` are
then valid kernel arguments.

More in docs/modules.md, ``orin_vlm_node/cuda/runtime.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .build import BuildConfig, CompiledModule, arch_from_capability, build_all
from .launch import ARG_KINDS, LaunchConfig, check_launch_args
from .sources import KernelSources, find_kernel_sources

_log = logging.getLogger(__name__)

_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16


class CudaRuntimeError(RuntimeError):
    """Loading or launching a kernel failed in the CUDA driver; the message names the call and the error."""


_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value union (its first int used here)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (cuda.h): the grid, block, shared memory and stream of ``cuLaunchKernelEx``."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


class _Driver:
    """The few driver-API entry points we need, bound with ctypes."""

    def __init__(self) -> None:
        lib = None
        for name in ("libcuda.so.1", "libcuda.so"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if lib is None:
            raise CudaRuntimeError("libcuda (the NVIDIA driver library) could not be loaded")
        self.lib = lib
        vp, u, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        self._sig("cuModuleLoadData", [ctypes.POINTER(vp), ctypes.c_char_p])
        self._sig("cuModuleGetFunction", [ctypes.POINTER(vp), vp, ctypes.c_char_p])
        self._sig("cuModuleUnload", [vp])
        self._sig("cuLaunchKernel", [vp, u, u, u, u, u, u, u, vp, ctypes.POINTER(vp), ctypes.POINTER(vp)])
        self._sig("cuCtxGetCurrent", [ctypes.POINTER(vp)])
        self._sig("cuGetErrorName", [i, ctypes.POINTER(ctypes.c_char_p)])
        # cuLaunchKernelEx came with CUDA 12.0; an older driver has none, and then launches stay plain.
        self.has_launch_ex = hasattr(lib, "cuLaunchKernelEx")
        if self.has_launch_ex:
            self._sig("cuLaunchKernelEx", [ctypes.POINTER(_LaunchConfig), vp, ctypes.POINTER(vp), ctypes.POINTER(vp)])

    def _sig(self, name: str, argtypes: list) -> None:
        fn = getattr(self.lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int

    def check(self, rc: int, what: str) -> None:
        if rc:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise CudaRuntimeError(f"{what} failed: {(name.value or b'CUDA error').decode()} ({rc})")

    def current_context(self) -> int:
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        return ctx.value or 0


class KernelRuntime:
    """The built kernels, loaded once, launchable from any thread: ``launch(cfg, args)``.

    ``args`` follow the kernel's parameter list (``launch.ARG_KINDS``): tensors (or None for a null
    pointer) for pointers, Python ints and floats for scalars, refused by ``launch.check_launch_args``
    (LaunchArgumentError) before anything is launched. The CPU harness has the same method and checks.
    """

    def __init__(self, modules: Sequence[CompiledModule], device: torch.device) -> None:
        import pycuda.driver as drv  # lazily: pycuda is optional and needs a GPU

        self.device = device
        self.arch = modules[0].arch if modules else ""
        self.dtypes = sorted({tag for m in modules for tag in m.dtypes})  # the storage types it has kernels for
        torch.cuda.init()
        drv.init()
        self._pyctx = drv.Device(device.index or 0).retain_primary_context()
        self._driver = _Driver()
        self._local = threading.local()
        self._modules: list[ctypes.c_void_p] = []
        self._functions: dict[str, ctypes.c_void_p] = {}
        self._pyctx.push()
        try:
            self._ctx_handle = self._driver.current_context()
            for compiled in modules:
                mod = ctypes.c_void_p()
                self._driver.check(
                    self._driver.lib.cuModuleLoadData(ctypes.byref(mod), compiled.cubin),
                    f"loading {compiled.path.name}",
                )
                self._modules.append(mod)
                for kernel in compiled.kernels:
                    fn = ctypes.c_void_p()
                    self._driver.check(
                        self._driver.lib.cuModuleGetFunction(ctypes.byref(fn), mod, kernel.encode()),
                        f"looking up kernel {kernel}",
                    )
                    self._functions[kernel] = fn
        except BaseException:
            # The modules loaded before the failure would hold GPU memory for the process's life (the caller
            # rebuilds and loads again, or starts on the torch path): they are unloaded first, and the load's
            # error is the one raised.
            with contextlib.suppress(CudaRuntimeError):
                self._unload()
            raise
        finally:
            self._pyctx.pop()
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        self.programmatic = False  # dependent launches in captured graphs (module docstring): the check below
        attr = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self._programmatic_attr = ctypes.pointer(attr)
        self.programmatic_status = self._check_programmatic()
        _log.info("loaded %d CUDA kernels (%s, %d SMs; programmatic dependent launch: %s)", len(self._functions),
                  self.arch, self.sm_count, self.programmatic_status)  # fmt: skip

    @property
    def num_kernels(self) -> int:
        return len(self._functions)

    def kernels(self) -> list[str]:
        """Names of the loaded kernels (diagnostics)."""
        return sorted(self._functions)

    def close(self) -> None:
        """Unload the modules (their code leaves the GPU's memory) once nothing will launch them again: the
        engine calls it when a reconfiguration replaced this runtime and freed what was captured with it. A
        launch after it raises CudaRuntimeError; a second call does nothing."""
        if not self._modules:
            return
        self._pyctx.push()
        try:
            self._unload()
        finally:
            self._pyctx.pop()

    def _unload(self) -> None:
        """Unload every loaded module (the primary context current); the first failure is raised once all
        were tried."""
        self._functions.clear()
        modules, self._modules = self._modules, []
        failures = [rc for rc in (self._driver.lib.cuModuleUnload(mod) for mod in modules) if rc]
        if failures:
            self._driver.check(failures[0], "cuModuleUnload")

    def _ensure_context(self) -> None:
        """Make the primary context current on this thread (torch usually has; a fresh thread may not)."""
        if self._driver.current_context() != self._ctx_handle:
            self._pyctx.push()
            self._local.pushed = getattr(self._local, "pushed", 0) + 1

    def launch(self, cfg: LaunchConfig, args: Sequence[torch.Tensor | int | float | None]) -> None:
        fn = self._functions.get(cfg.kernel)
        if fn is None:
            raise CudaRuntimeError(f"kernel {cfg.kernel} is not loaded (kernels built for: {', '.join(self.dtypes)})")
        check_launch_args(cfg, args, self.device)
        values: list[ctypes._SimpleCData] = []
        for kind, value in zip(ARG_KINDS[cfg.family], args, strict=True):
            if kind == "ptr":
                values.append(ctypes.c_void_p(0 if value is None else value.data_ptr()))
            elif kind == "i32":
                values.append(ctypes.c_int32(int(value)))
            else:
                values.append(ctypes.c_float(float(value)))
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        self._ensure_context()
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        if self.programmatic and torch.cuda.is_current_stream_capturing():
            launch = _LaunchConfig((ctypes.c_uint * 3)(*cfg.grid), (ctypes.c_uint * 3)(*cfg.block), cfg.shared_bytes,
                                   stream, self._programmatic_attr, 1)  # fmt: skip
            rc = self._driver.lib.cuLaunchKernelEx(ctypes.byref(launch), fn, params, None)
        else:
            rc = self._driver.lib.cuLaunchKernel(fn, *cfg.grid, *cfg.block, cfg.shared_bytes, stream, params, None)
        self._driver.check(rc, f"launching {cfg.kernel} grid={cfg.grid} block={cfg.block}")

    @contextlib.contextmanager
    def dependent_launches(self, on: bool) -> Iterator[None]:
        """Launches captured in the block are programmatic dependent (``on``, where ``programmatic_status`` is
        "on") or plain; the switch is back as it was after the block."""
        before = self.programmatic
        self.programmatic = on and self.programmatic_status == "on"
        try:
            yield
        finally:
            self.programmatic = before

    def _check_programmatic(self) -> str:
        """Turn dependent launches on where this GPU and driver run them right; "on", or "off (why)".

        The check: a copy by torch (a memcpy node, as a decode graph has between kernels), then silu_mul
        twice, the second launch reading the first's output, captured in a CUDA graph with dependent
        launches and replayed, must give what the same steps give with plain launches, bit for bit (the
        kernels are the same; only the launch differs)."""
        from .launch import DTYPE_TAGS, silu_mul_launch

        if torch.cuda.get_device_capability(self.device) < (9, 0):
            return f"off ({self.arch}: it needs sm_90 or later)"
        if not self._driver.has_launch_ex:
            return "off (the driver has no cuLaunchKernelEx)"
        loaded = [name for name, tag in DTYPE_TAGS.items() if f"silu_mul_{tag}" in self._functions]
        if not loaded:
            return "off (no silu_mul kernel, which the check launches, is loaded)"
        dtype = getattr(torch, loaded[0])  # the first storage type loaded: fp32 where it is, else the model's
        gate_up = torch.linspace(-6.0, 6.0, 4 * 512, device=self.device).reshape(4, 512).to(dtype)  # (4, 2 x 256)

        def two_launches() -> torch.Tensor:
            copied = gate_up.clone()
            first = torch.empty(4, 256, device=self.device, dtype=dtype)
            self.launch(silu_mul_launch(4, 256, dtype), [first, copied, 4, 256])
            second = torch.empty(4, 128, device=self.device, dtype=dtype)
            self.launch(silu_mul_launch(4, 128, dtype), [second, first, 4, 128])
            return second

        expected = two_launches()
        self.programmatic = True
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = two_launches()
            graph.replay()
            torch.cuda.synchronize(self.device)
            if not torch.equal(captured, expected):
                raise CudaRuntimeError("dependent launches gave other values than plain ones")
        except Exception as exc:  # noqa: BLE001 - any failure leaves launches plain, and says why
            self.programmatic = False
            torch.cuda.synchronize(self.device)
            return f"off ({type(exc).__name__}: {exc})"
        return "on"


def detect_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return arch_from_capability(major, minor)


def load_runtime(
    device: torch.device,
    kernel_dir: str = "",
    cache_dir: str = "",
    nvcc: str = "",
    dtypes: Sequence[str] = ("",),
    reuse: Sequence[LoadedKernels] = (),
) -> LoadedKernels:
    """Find the sources, build (or take from the cache) every kernel for ``device``'s arch and each storage type
    of ``dtypes`` (``launch.DTYPE_TAGS`` values; "" = every type in one build), load them.

    A runtime of ``reuse`` (loaded earlier in this process, not closed) that holds the very same cubins on the
    same device is returned instead of loading them again: a module loaded is GPU memory until it is unloaded,
    and a robot's reconfigurations (page size, graphs, pool size) would otherwise load the same code again each
    time.

    A cached cubin that passes its hash check but fails to load (a driver change the key did not see) is
    deleted and rebuilt once. Raises KernelBuildError (sources, nvcc, compile) or CudaRuntimeError (driver).
    """
    t0 = time.perf_counter()
    sources = find_kernel_sources(kernel_dir)
    cfg = BuildConfig(arch=detect_arch(device), kernel_dir=sources.directory, cache_dir=cache_dir, nvcc=nvcc)
    modules = build_all(cfg, list(sources.modules), dtypes)
    paths = tuple(m.path for m in modules)
    for earlier in reuse:
        if earlier.paths == paths and earlier.runtime.device == device:
            cached = sum(m.cache_hit for m in modules)
            return LoadedKernels(earlier.runtime, sources, time.perf_counter() - t0, cached, len(modules) - cached,
                                 paths, reused=True)  # fmt: skip
    try:
        runtime = KernelRuntime(modules, device)
    except CudaRuntimeError as exc:
        stale = [m for m in modules if m.cache_hit]
        if not stale:
            raise
        _log.warning("a cached kernel failed to load (%s); rebuilding %s", exc, ", ".join(m.name for m in stale))
        for m in stale:
            m.path.unlink(missing_ok=True)
        modules = build_all(cfg, list(sources.modules), dtypes)
        runtime = KernelRuntime(modules, device)
    cached = sum(m.cache_hit for m in modules)
    return LoadedKernels(runtime, sources, time.perf_counter() - t0, cached, len(modules) - cached, paths)


@dataclass(frozen=True)
class LoadedKernels:
    """The loaded runtime and how it came to be (for the startup log and diagnostics): the cubins it holds
    (``paths``, the cache entries, named by their sources, arch, flags and nvcc) and whether it was loaded by
    an earlier call (``reused``)."""

    runtime: KernelRuntime
    sources: KernelSources
    seconds: float
    cached: int
    compiled: int
    paths: tuple[Path, ...]
    reused: bool = False

    def describe(self) -> str:
        r = self.runtime
        return (
            f"{r.arch}, {r.num_kernels} kernels ({'/'.join(r.dtypes)}) from {self.sources.directory} "
            f"({self.sources.found_by}), "
            f"{self.compiled} compiled + {self.cached} cached in {self.seconds:.1f} s"
            f"{' (loaded before, reused)' if self.reused else ''}, "
            f"programmatic dependent launch {r.programmatic_status}"
        )
