"""``KernelRuntime`` loading and unloading its modules, against a stand-in driver library (ctypes' calls
answered in Python) and a stand-in PyCUDA context: what is loaded is unloaded again, also when a load fails
halfway (a cubin the driver refuses), so a robot's node that retries or falls back to the torch path does not
keep the modules loaded before the failure in GPU memory for the rest of its life."""

from __future__ import annotations

import ctypes
import sys
import types
from pathlib import Path

import pytest
import torch

from orin_vlm_node.cuda import runtime as R
from orin_vlm_node.cuda.build import CompiledModule

_INVALID_IMAGE = 200  # CUDA_ERROR_INVALID_IMAGE


class FakeDriverLib:
    """The driver entry points ``KernelRuntime`` calls; modules are handles 1, 2, ...; a cubin equal to
    ``refused`` fails to load."""

    def __init__(self, refused: bytes = b"") -> None:
        self.refused = refused
        self.loaded: dict[int, bytes] = {}
        self.unloaded: list[int] = []

    def cuCtxGetCurrent(self, ctx_ref) -> int:
        ctx_ref._obj.value = 7
        return 0

    def cuModuleLoadData(self, mod_ref, cubin: bytes) -> int:
        if cubin == self.refused:
            return _INVALID_IMAGE
        handle = len(self.loaded) + len(self.unloaded) + 1
        self.loaded[handle] = cubin
        mod_ref._obj.value = handle
        return 0

    def cuModuleGetFunction(self, fn_ref, mod: ctypes.c_void_p, name: bytes) -> int:
        fn_ref._obj.value = 1000 + mod.value
        return 0

    def cuModuleUnload(self, mod: ctypes.c_void_p) -> int:
        self.loaded.pop(mod.value)
        self.unloaded.append(mod.value)
        return 0

    def cuGetErrorName(self, rc: int, name_ref) -> int:
        name_ref._obj.value = b"CUDA_ERROR_INVALID_IMAGE"
        return 0


@pytest.fixture
def driver(monkeypatch) -> FakeDriverLib:
    """The stand-in driver, with PyCUDA's primary context (pushes and pops counted) and torch's CUDA calls
    that loading makes answered without a GPU."""
    lib = FakeDriverLib()
    context = types.SimpleNamespace(depth=0)
    context.push = lambda: setattr(context, "depth", context.depth + 1)
    context.pop = lambda: setattr(context, "depth", context.depth - 1)
    lib.context = context

    def fake_driver(self) -> None:
        self.lib, self.has_launch_ex = lib, False

    drv = types.ModuleType("pycuda.driver")
    drv.init = lambda: None
    drv.Device = lambda index: types.SimpleNamespace(retain_primary_context=lambda: context)
    monkeypatch.setitem(sys.modules, "pycuda", types.ModuleType("pycuda"))
    monkeypatch.setitem(sys.modules, "pycuda.driver", drv)
    monkeypatch.setattr(sys.modules["pycuda"], "driver", drv, raising=False)
    monkeypatch.setattr(R._Driver, "__init__", fake_driver)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(multi_processor_count=8)
    )
    monkeypatch.setattr(R.KernelRuntime, "_check_programmatic", lambda self: "off (no GPU here)")
    return lib


def modules(*cubins: bytes) -> list[CompiledModule]:
    names = ["rms_norm", "silu_mul", "gemv"]
    return [
        CompiledModule(names[i], "sm_87", c, Path(f"{names[i]}.cubin"), True, dtype="f16") for i, c in enumerate(cubins)
    ]


def test_the_modules_loaded_are_unloaded_by_close_once(driver):
    runtime = R.KernelRuntime(modules(b"A", b"B"), torch.device("cuda", 0))
    assert sorted(driver.loaded.values()) == [b"A", b"B"] and runtime.num_kernels > 0
    runtime.close()
    runtime.close()
    assert driver.loaded == {} and sorted(driver.unloaded) == [1, 2] and runtime.num_kernels == 0
    assert driver.context.depth == 0
    with pytest.raises(R.CudaRuntimeError, match="not loaded"):
        runtime.launch(types.SimpleNamespace(kernel="rms_norm_f16"), [])


def test_a_load_that_fails_halfway_unloads_what_it_had_loaded_and_says_which_cubin(driver):
    driver.refused = b"C"
    with pytest.raises(R.CudaRuntimeError, match=r"loading gemv\.cubin failed: CUDA_ERROR_INVALID_IMAGE"):
        R.KernelRuntime(modules(b"A", b"B", b"C"), torch.device("cuda", 0))
    assert driver.loaded == {} and sorted(driver.unloaded) == [1, 2]
    assert driver.context.depth == 0
