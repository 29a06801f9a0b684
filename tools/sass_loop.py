"""Instructions a kernel's main loop issues, from its SASS: ``python -m tools.sass_loop gemv_int4_f16_r1``.

Why: at batch 1 a quantized product is bound by its bytes only while the GPU can issue the arithmetic of a
weight in the time the weight's bytes take to arrive, so the instructions a weight are the figure to hold
kernel changes to, and it can be read without a GPU. The kernel's module is compiled with the startup
builder's flags (``build.compile_cubin``) for ``--arch``, disassembled with ``cuobjdump -sass`` (CUDA's
``cuobjdump``, next to ``nvcc`` or on PATH; the pip wheel ``nvidia-cuda-cuobjdump`` has it too), and the
main loops are the backward branches whose bodies hold no other loop that loads 16-byte vectors
(``LDG.E.128``) and, of those, load the most: the GEMVs' vector loop (an MLP kernel has two, its SwiGLU
product's and its down product's; a branch around both is not a main loop). Printed for each: its
instruction count, its opcodes, and instructions a weight for the GEMV kernels (a lane's loop step reads
``kGemvInFlight`` = 8 weight vectors of 32 int4, 16 int8, 8 fp16/bf16 or 4 fp32 weights).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from orin_vlm_node.cuda import build as B
from orin_vlm_node.cuda.launch import KERNEL_MODULES
from orin_vlm_node.cuda.sources import find_kernel_sources

GEMV_IN_FLIGHT = 8  # kGemvInFlight in kernels/gemv.cuh: weight vectors a lane's loop step loads
GEMV_VECTOR_WEIGHTS = {"int4": 32, "int8": 16, "f16": 8, "bf16": 8, "f32": 4}  # weights in a 16-byte vector

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BACKWARD = re.compile(r"\bBRA\s+(?:!?U?P\d+,\s*)?0x([0-9a-f]+)")
_PREDICATE = re.compile(r"^@!?U?P[T\d]+\s+")


@dataclass(frozen=True)
class Loop:
    """The instructions of one loop body (its first, at ``start``, to its backward branch, at ``end``), as
    disassembled."""

    start: int
    end: int
    instructions: list[str]

    @property
    def vector_loads(self) -> int:
        return sum("LDG.E.128" in i for i in self.instructions)

    def opcodes(self) -> Counter:
        """Opcode (without modifiers or predicate) -> count."""
        return Counter(_PREDICATE.sub("", i).split()[0].split(".")[0] for i in self.instructions)


def main_loops(sass: str) -> list[Loop]:
    """The loops of ``sass`` (one function's ``cuobjdump -sass`` text) that hold no other loop with 16-byte loads
    and, of those, have the most 16-byte loads, in address order; ValueError when it has no backward branch."""
    code = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, sass.splitlines()) if m]
    loops = []
    for address, text in code:
        branch = _BACKWARD.search(text)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            loops.append(Loop(start, address, [t for a, t in code if start <= a <= address]))
    if not loops:
        raise ValueError("no loop (backward branch) in the disassembly")

    def holds_another(loop: Loop) -> bool:
        return any(o is not loop and o.vector_loads and loop.start <= o.start <= o.end <= loop.end for o in loops)

    inner = [loop for loop in loops if not holds_another(loop)]
    most = max(loop.vector_loads for loop in inner)
    return sorted((loop for loop in inner if loop.vector_loads == most), key=lambda loop: loop.start)


def gemv_weights_per_step(kernel: str) -> int | None:
    """Weights one lane's loop step reads in a ``gemv_*`` kernel, else None."""
    match = re.fullmatch(r"gemv_(float|int8|int4)(?:_swiglu)?_(f32|f16|bf16)_r\d+", kernel)
    if not match:
        return None
    mode, dtype = match.groups()
    return GEMV_IN_FLIGHT * GEMV_VECTOR_WEIGHTS[dtype if mode == "float" else mode]


def disassemble(kernel: str, arch: str, nvcc: str, cuobjdump: str) -> str:
    """``kernel``'s SASS for ``arch``, its module compiled as the node compiles it."""
    module = next((m for m, names in KERNEL_MODULES.items() if kernel in names), None)
    if module is None:
        raise SystemExit(f"no kernel {kernel!r} in any module (launch.KERNEL_MODULES)")
    cfg = B.BuildConfig(arch=arch, kernel_dir=find_kernel_sources().directory, nvcc=nvcc)
    with tempfile.TemporaryDirectory(prefix="sass_loop_") as tmp:
        cubin = Path(tmp) / f"{module}.cubin"
        cubin.write_bytes(B.compile_cubin(module, cfg, nvcc))
        proc = subprocess.run([cuobjdump, "-sass", "-fun", kernel, str(cubin)], capture_output=True, text=True,
                              check=True, timeout=120)  # fmt: skip
    return proc.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", help="kernel name, e.g. gemv_int4_f16_r1")
    parser.add_argument("--arch", default="sm_87", help="SASS architecture (default sm_87, Orin)")
    parser.add_argument("--nvcc", default="", help="nvcc to compile with (default: PATH, /usr/local/cuda)")
    parser.add_argument("--cuobjdump", default="", help="cuobjdump (default: next to nvcc, then PATH)")
    args = parser.parse_args(argv)
    nvcc = B.find_nvcc(args.nvcc)
    cuobjdump = args.cuobjdump or shutil.which("cuobjdump", path=str(Path(nvcc).parent)) or shutil.which("cuobjdump")
    if not cuobjdump:
        print("cuobjdump not found (set --cuobjdump; pip download nvidia-cuda-cuobjdump has one)", file=sys.stderr)
        return 1
    weights = gemv_weights_per_step(args.kernel)
    for loop in main_loops(disassemble(args.kernel, args.arch, nvcc, cuobjdump)):
        print(f"{args.kernel} ({args.arch}): main loop {len(loop.instructions)} instructions, "
              f"{loop.vector_loads} 16-byte loads")  # fmt: skip
        if weights:
            print(f"  {weights} weights a lane's step: {len(loop.instructions) / weights:.2f} instructions a weight")
        print("  " + " ".join(f"{n} {op}" for op, n in loop.opcodes().most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
