"""The driver structures ``runtime.py`` passes to ``cuLaunchKernelEx``, against the C layout of cuda.h.

A wrong offset would hand the driver a garbage stream or attribute on the GPU; here a C program compiled
against the CUDA toolkit's own header prints the sizes and offsets the ctypes structures must have.
Skipped where no cuda.h or C compiler is installed.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from orin_vlm_node.cuda.runtime import (
    _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
    _LaunchAttribute,
    _LaunchConfig,
)

CUDA_INCLUDE = next(
    (p for p in (Path("/usr/local/cuda/include"), Path("/usr/include")) if (p / "cuda.h").is_file()), None
)
CC = shutil.which("cc") or shutil.which("gcc")

pytestmark = pytest.mark.skipif(CUDA_INCLUDE is None or CC is None, reason="needs cuda.h and a C compiler")

PROGRAM = r"""
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>
int main(void) {
  printf("%zu %zu %zu %zu %zu %zu %zu %zu %d\n", sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, sharedMemBytes),
         offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),
         sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),
         offsetof(CUlaunchAttribute, value.programmaticStreamSerializationAllowed),
         (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
  return 0;
}
"""


def test_launch_structures_match_cuda_h(tmp_path):
    source, exe = tmp_path / "layout.c", tmp_path / "layout"
    source.write_text(PROGRAM)
    subprocess.run([CC, "-I", str(CUDA_INCLUDE), "-o", str(exe), str(source)], check=True, timeout=120)
    c = [int(v) for v in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    ours = [
        ctypes.sizeof(_LaunchConfig),
        _LaunchConfig.shared_bytes.offset,
        _LaunchConfig.stream.offset,
        _LaunchConfig.attrs.offset,
        _LaunchConfig.num_attrs.offset,
        ctypes.sizeof(_LaunchAttribute),
        _LaunchAttribute.value.offset,
        _LaunchAttribute.value.offset,  # the allowed-flag is the union's first member
        _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
    ]
    assert ours == c
