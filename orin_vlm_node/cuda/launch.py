"""Launch geometry of every kernel as pure functions of the problem shape.

The PyCUDA runtime and the CPU harness both take grid, block and shared-memory sizes from here, so
the configuration the tests prove correct is the one the GPU runs. The constants mirror the
``constexpr`` values in ``kernels/*.cu`` (a mismatch makes the kernel trap, which the harness
tests catch). No torch or CUDA import: everything here runs anywhere.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Mirrors of the kernel constants (kernels/paged_decode_attention.cu, paged_prefill_attention.cu).
DECODE_WARPS = 4
DECODE_STAGES = 2  # kDecodeStages: steps of K/V a decode thread has staged in shared memory at once
DECODE_STAGE_VECS = 8  # kStageVecs: 16-byte vectors a decode thread stages for one step (at most)
PREFILL_WARPS = 4
PREFILL_BLOCK_K = 32
KV_WRITE_THREADS = 128
GEMV_WARPS = 4  # kGemvWarps in kernels/gemv.cuh: warps per block
WARP_SIZE = 32

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)  # ORIN_FOR_EACH_HEAD_DIM in kernels/attention_common.cuh
# Query heads one decode block serves (upper bounds it is instantiated for). A larger GQA group is split
# into chunks of the largest bucket, one block each (the kernel reads K/V once per chunk).
GROUP_BUCKETS = (1, 2, 4, 8)
MAX_DYNAMIC_SHARED_BYTES = 48 * 1024  # the per-block default on every GPU we target; no opt-in needed
DEFAULT_MIN_TOKENS_PER_SPLIT = 16  # one warp step of every decode warp: a shorter split only adds reduce work
# Decode blocks per SM the split plan aims for: one block holds only DECODE_WARPS warps, each with a few tokens'
# K/V loads in flight, so a memory-bound kernel needs several blocks per SM to keep enough loads in flight.
DECODE_BLOCKS_PER_SM = 8

NORM_THREADS = 128  # kNormThreads in kernels/add_rms_norm.cuh
MAX_ROPE_DIM = 256  # kMaxRopeDim in kernels/norm_rope.cuh: the rows the norm + RoPE kernel rotates (head_dim)
NORM_KERNELS = ("rms_norm", "rms_norm_rope", "add_rms_norm", "rope_tables")  # the kinds of kernels/rms_norm.cu
SILU_THREADS = 256  # kSiluThreads in kernels/silu_mul.cu
WIDEN_THREADS = 256  # kWidenThreads in kernels/widen_int4.cu

# Rows of x one GEMV kernel is instantiated for (a launch takes the smallest that holds its rows); more rows
# than the largest (a prefill) take torch's GEMM instead.
GEMV_ROW_BUCKETS = (1, 2, 4, 8)
GEMV_MODES = ("float", "int8", "int4")  # how the weight is stored: the activations' dtype, or quantized
GEMV_EPILOGUES = ("", "_swiglu")  # the product itself, or silu(gate) * up of a fused gate/up weight
# Output columns one GEMV warp computes, by weight storage and whether the epilogue is SwiGLU (kGemvColumns
# in kernels/gemv.cuh): quantized weights share each widened piece of x between the weight rows a warp reads
# (int8 two, int4 four: four columns, or two with their up rows).
GEMV_COLUMNS = {("float", False): 1, ("float", True): 1, ("int8", False): 2, ("int8", True): 2,
                ("int4", False): 4, ("int4", True): 2}  # fmt: skip

GEMV_IN_FLIGHT = 8  # kGemvInFlight: 16-byte vectors a lane loads before it uses the first, over its rows
GEMV_INT4_CHUNK = 32  # kGemvChunk<uint8_t>: int4 weights in a 16-byte vector (others: 16 bytes / element size)

# torch dtype name -> kernel name suffix and element size.
DTYPE_TAGS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kernel_modules(tags: Iterable[str] = DTYPE_TAGS.values()) -> dict[str, tuple[str, ...]]:
    """Kernel source module (kernels/<module>.cu) -> the extern "C" kernels it defines for the storage types
    ``tags`` (DTYPE_TAGS values): a build for one type (``build.BuildConfig.dtype``) defines that type's only."""
    tags = tuple(tags)
    return {
        "paged_decode_attention": tuple(
            f"paged_decode_attention_{t}_d{d}_g{g}" for t in tags for d in SUPPORTED_HEAD_DIMS for g in GROUP_BUCKETS
        ),
        "paged_prefill_attention": tuple(
            f"paged_prefill_attention_{t}_d{d}" for t in tags for d in SUPPORTED_HEAD_DIMS
        ),
        "paged_kv_write": tuple(f"paged_kv_write_{t}" for t in tags),
        **{
            f"gemv{epilogue}": tuple(
                f"gemv_{mode}{epilogue}_{t}_r{r}" for mode in GEMV_MODES for t in tags for r in GEMV_ROW_BUCKETS
            )
            for epilogue in GEMV_EPILOGUES
        },
        "rms_norm": tuple(f"{kind}_{t}" for kind in NORM_KERNELS for t in tags),
        "silu_mul": tuple(f"silu_mul_{t}" for t in tags),
        "widen_int4": tuple(f"widen_int4_{t}" for t in tags),
    }


# Every module's kernels for every storage type: what a build without a type defines.
KERNEL_MODULES: dict[str, tuple[str, ...]] = kernel_modules()

# Parameter kinds of each kernel family, in order: "ptr" (device pointer), "i32", "f32".
ARG_KINDS: dict[str, tuple[str, ...]] = {
    "paged_decode_attention": ("ptr",) * 9 + ("i32",) * 6 + ("f32",),
    "paged_prefill_attention": ("ptr",) * 7 + ("i32",) * 4 + ("f32",),
    "paged_kv_write": ("ptr",) * 5 + ("i32",),
    "gemv": ("ptr",) * 5 + ("i32",) * 4,  # y, x, weight, scales, offsets; rows, N, K, group
    "rms_norm": ("ptr",) * 4 + ("i32",) * 4 + ("f32",),
    "rms_norm_rope": ("ptr",) * 10 + ("i32",) * 5 + ("f32",),
    "add_rms_norm": ("ptr",) * 5 + ("i32", "f32"),
    "rope_tables": ("ptr",) * 5 + ("i32",) * 2,
    "silu_mul": ("ptr",) * 2 + ("i32",) * 2,
    "widen_int4": ("ptr",) * 4 + ("i32",) * 3,  # out, qweight, scales, offsets; N, K, group
}


class UnsupportedShape(ValueError):
    """The kernels have no instantiation for this head_dim / dtype / GQA ratio."""


@dataclass(frozen=True)
class LaunchConfig:
    """One kernel launch: which kernel, grid and block (x, y, z) and dynamic shared memory in bytes."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int = 0

    @property
    def family(self) -> str:
        return kernel_family(self.kernel)


def kernel_family(kernel: str) -> str:
    """``paged_decode_attention_f16_d128_g4`` -> ``paged_decode_attention`` (the key of ARG_KINDS)."""
    for family in sorted(ARG_KINDS, key=len, reverse=True):
        if kernel.startswith(family + "_"):
            return family
    raise KeyError(f"unknown kernel {kernel!r}")


I32_RANGE = (-(2**31), 2**31 - 1)


class LaunchArgumentError(ValueError):
    """A launch's arguments do not fit the kernel's parameter list (``ARG_KINDS``); the message names the
    kernel, the argument and why."""


def check_launch_args(cfg: LaunchConfig, args: Sequence[object], device: object) -> None:
    """Refuse (LaunchArgumentError) arguments that the kernel of ``cfg`` would misread on ``device``: the
    GPU runtime and the CPU harness both call this before they marshal anything, so a launch the CPU tests
    run is one the GPU takes.

    Pointers: a tensor (or None, a null pointer) on ``device`` with non-negative strides and a dense last
    dimension. The kernels index their tensors themselves, reading dense innermost rows and taking the outer
    stride they honour as an argument of their own (the q/k norm reads the heads of the fused QKV projection
    in place), so such a view is passed as it is. Ints: within int32 (a larger one would wrap silently).
    Floats: a real number."""
    kinds = ARG_KINDS[cfg.family]
    if len(args) != len(kinds):
        raise LaunchArgumentError(f"{cfg.kernel} takes {len(kinds)} arguments, got {len(args)}")
    for i, (kind, value) in enumerate(zip(kinds, args, strict=True)):
        problem = _argument_problem(kind, value, device)
        if problem:
            raise LaunchArgumentError(f"{cfg.kernel} argument {i}: {problem}")


def _argument_problem(kind: str, value: object, device: object) -> str | None:
    if kind == "i32":
        ok = isinstance(value, numbers.Integral) and I32_RANGE[0] <= int(value) <= I32_RANGE[1]
        return None if ok else f"expected an int32, got {value!r}"
    if kind == "f32":
        return None if isinstance(value, numbers.Real) else f"expected a float, got {value!r}"
    if value is None:
        return None
    if getattr(value, "device", None) != device or not callable(getattr(value, "stride", None)):
        return f"expected a tensor on {device}"
    strides, shape = value.stride(), value.shape
    if min(strides, default=0) < 0 or (shape and shape[-1] > 1 and strides[-1] != 1):
        return f"expected non-negative strides and a dense last dimension, got shape {tuple(shape)} strides {strides}"
    return None


def dtype_name(dtype: object) -> str:
    """Accepts a torch.dtype, a numpy dtype or a name; returns e.g. ``"float16"``."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_TAGS:
        raise UnsupportedShape(f"no kernels for dtype {dtype}; supported: {', '.join(DTYPE_TAGS)}")
    return name


def check_head_dim(head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise UnsupportedShape(f"no kernels for head_dim {head_dim}; supported: {SUPPORTED_HEAD_DIMS}")


def gqa_group(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per kv head; any group that divides the head count is served."""
    if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads:
        raise UnsupportedShape(f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
    return num_heads // num_kv_heads


def group_bucket(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per decode block: the smallest instantiated bucket that holds the group, else the largest."""
    group = gqa_group(num_heads, num_kv_heads)
    return next((bucket for bucket in GROUP_BUCKETS if group <= bucket), GROUP_BUCKETS[-1])


def group_chunks(num_heads: int, num_kv_heads: int) -> int:
    """Decode blocks per kv head: 1 up to the largest bucket, more for larger GQA groups."""
    return math.ceil(gqa_group(num_heads, num_kv_heads) / group_bucket(num_heads, num_kv_heads))


def decode_kernel_name(dtype: object, head_dim: int, num_heads: int, num_kv_heads: int) -> str:
    check_head_dim(head_dim)
    tag = DTYPE_TAGS[dtype_name(dtype)]
    return f"paged_decode_attention_{tag}_d{head_dim}_g{group_bucket(num_heads, num_kv_heads)}"


def decode_shared_bytes(head_dim: int, group: int) -> int:
    """The K/V staging area (stages x vectors x threads, 16 bytes each), which the cross-warp merge buffer
    (acc [warps][group][head_dim] + m, l [warps][group], fp32) reuses after the loop: the larger of the two."""
    merge = DECODE_WARPS * group * (head_dim + 2) * 4
    staging = DECODE_STAGES * DECODE_STAGE_VECS * DECODE_WARPS * WARP_SIZE * 16
    return max(merge, staging)


def choose_decode_splits(
    max_seq_len: int,
    batch: int,
    blocks_per_seq: int,
    sm_count: int,
    min_tokens_per_split: int = DEFAULT_MIN_TOKENS_PER_SPLIT,
) -> tuple[int, int]:
    """Split-K plan ``(num_splits, tokens_per_split)`` for sequences of up to ``max_seq_len`` tokens.

    ``blocks_per_seq`` is the decode grid's x size (kv heads x group chunks). A split's tokens are the
    longest of three: enough to keep about ``DECODE_BLOCKS_PER_SM`` blocks on every SM (fewer blocks leave
    loads out of flight; more only add partial results to reduce), about the square root of the length
    (the reduce's work grows with the number of splits, a split's with its tokens), and
    ``min_tokens_per_split``; in multiples of 16 tokens. Measured on an H200 (132 SMs, 8 kv heads,
    head_dim 128, device time in CUDA graphs): splits of 32, 64 and 128 tokens were the fastest at 1k, 4k
    and 16k of context, 2-3x faster than the earlier plan of at least 256 tokens and 2 blocks per SM; on an
    Orin's 16 SMs the occupancy term gives splits of 256 tokens at 4k. For a CUDA graph pass the capacity
    of the table row (not the current length): the plan must stay fixed while the graph replays.
    """
    if max_seq_len < 1 or batch < 1 or blocks_per_seq < 1 or sm_count < 1:
        raise ValueError("choose_decode_splits needs positive sizes")
    by_occupancy = math.ceil(max_seq_len * batch * blocks_per_seq / (DECODE_BLOCKS_PER_SM * sm_count))
    by_length = 2 ** round(math.log2(math.sqrt(max_seq_len)))
    tokens = max(min_tokens_per_split, by_occupancy, by_length)
    tokens = math.ceil(tokens / 16) * 16  # the smallest step of a decode block (4 warps x 2 tokens x 2)
    if tokens >= max_seq_len:
        return 1, max_seq_len
    return math.ceil(max_seq_len / tokens), tokens


def decode_launch(
    batch: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: object, num_splits: int = 1
) -> LaunchConfig:
    """Grid (num_kv_heads * group chunks, batch, num_splits), DECODE_WARPS warps, merge buffer in shared memory.
    With splits the kernel also takes :func:`decode_counters` of them (the last split to finish combines)."""
    if batch < 1 or num_splits < 1:
        raise ValueError(f"decode launch needs batch >= 1 and num_splits >= 1, got {batch}, {num_splits}")
    kernel = decode_kernel_name(dtype, head_dim, num_heads, num_kv_heads)
    group = group_bucket(num_heads, num_kv_heads)
    return _checked(
        LaunchConfig(
            kernel=kernel,
            grid=(num_kv_heads * group_chunks(num_heads, num_kv_heads), batch, num_splits),
            block=(DECODE_WARPS * WARP_SIZE, 1, 1),
            shared_bytes=decode_shared_bytes(head_dim, group),
        )
    )


def decode_counters(cfg: LaunchConfig) -> int:
    """Counters a split-K decode launch of ``cfg`` takes: one per (sequence, kv head chunk), each counting
    that group's finished splits (uint32, zero before the launch; the kernel leaves them zero)."""
    return cfg.grid[0] * cfg.grid[1]


def prefill_block_q(head_dim: int) -> int:
    """Query rows per prefill block (``PrefillTile`` in the kernel): 8 at head_dim 256, else 16."""
    return 8 if head_dim > 128 else 16


def prefill_shared_bytes(head_dim: int) -> int:
    """q tile + one padded K-then-V tile + per-row probabilities + key-valid flags, fp32."""
    block_q = prefill_block_q(head_dim)
    floats = block_q * head_dim + PREFILL_BLOCK_K * (head_dim + 1) + block_q * PREFILL_BLOCK_K + PREFILL_BLOCK_K
    return floats * 4


def prefill_launch(
    batch: int, max_q_len: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: object
) -> LaunchConfig:
    """Grid (ceil(max_q_len / block_q), num_heads, batch), PREFILL_WARPS warps."""
    check_head_dim(head_dim)
    gqa_group(num_heads, num_kv_heads)
    if batch < 1 or max_q_len < 1:
        raise ValueError(f"prefill launch needs batch >= 1 and max_q_len >= 1, got {batch}, {max_q_len}")
    tag = DTYPE_TAGS[dtype_name(dtype)]
    return _checked(
        LaunchConfig(
            kernel=f"paged_prefill_attention_{tag}_d{head_dim}",
            grid=(math.ceil(max_q_len / prefill_block_q(head_dim)), num_heads, batch),
            block=(PREFILL_WARPS * WARP_SIZE, 1, 1),
            shared_bytes=prefill_shared_bytes(head_dim),
        )
    )


def kv_write_launch(num_tokens: int, dtype: object) -> LaunchConfig:
    """One block per token (slot_mapping entry)."""
    tag = DTYPE_TAGS[dtype_name(dtype)]
    return _checked(LaunchConfig(f"paged_kv_write_{tag}", (num_tokens, 1, 1), (KV_WRITE_THREADS, 1, 1), 0))


def gemv_slices(mode: str, in_features: int, dtype: object, swiglu: bool = False) -> int:
    """Warps of a GEMV block that share its columns, each summing a slice of K (kernels/gemv.cuh: gemv_slices):
    1, 2 or GEMV_WARPS, as many as a warp's pass over a row takes steps of the vectors a lane has in flight."""
    columns = GEMV_COLUMNS[mode, swiglu]
    chunk = GEMV_INT4_CHUNK if mode == "int4" else 16 // (1 if mode == "int8" else DTYPE_BYTES[dtype_name(dtype)])
    unroll = max(1, GEMV_IN_FLIGHT // (columns * (2 if swiglu else 1)))
    steps = math.ceil(in_features / (WARP_SIZE * chunk * unroll))
    return 1 if steps <= 1 else 2 if steps == 2 else GEMV_WARPS


def gemv_launch(
    mode: str, rows: int, out_features: int, in_features: int, dtype: object, swiglu: bool = False
) -> LaunchConfig:
    """Grid (ceil(N / (GEMV_WARPS / slices * GEMV_COLUMNS[mode, swiglu]))), GEMV_WARPS warps (``slices`` of them
    sharing columns: :func:`gemv_slices`); the kernel of the smallest rows bucket that holds ``rows``.
    ``out_features`` N counts the output columns: with ``swiglu`` the weight has 2N rows (gate, then up) and
    the kernel writes silu(gate) * up; ``in_features`` K is the rows' length."""
    if mode not in GEMV_MODES:
        raise UnsupportedShape(f"no GEMV kernels for weights stored as {mode!r}; supported: {GEMV_MODES}")
    bucket = next((r for r in GEMV_ROW_BUCKETS if rows <= r), None)
    if rows < 1 or bucket is None:
        raise UnsupportedShape(f"GEMV kernels take 1..{GEMV_ROW_BUCKETS[-1]} rows, got {rows}")
    tag = DTYPE_TAGS[dtype_name(dtype)]
    block_columns = GEMV_WARPS // gemv_slices(mode, in_features, dtype, swiglu) * GEMV_COLUMNS[mode, swiglu]
    grid = (math.ceil(out_features / block_columns), 1, 1)
    kernel = f"gemv_{mode}{GEMV_EPILOGUES[swiglu]}_{tag}_r{bucket}"
    return _checked(LaunchConfig(kernel, grid, (GEMV_WARPS * WARP_SIZE, 1, 1), 0))


def rows_in_place(t) -> bool:
    """Whether (B, H, D) heads ``t`` can be read where they are by a kernel that takes a row stride and loads
    16-byte vectors: heads adjacent and dense, every row starting on a 16-byte boundary (the q heads of the
    q/k norm's output, whose rows also hold the k heads)."""
    size = t.element_size()
    return (
        t.dim() == 3
        and t.stride(2) == 1
        and t.stride(1) == t.shape[2]
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * size) % 16 == 0
    )


def check_kv_row(num_kv_heads: int, head_dim: int, dtype: object) -> int:
    """Elements of one pool row; the write kernels copy whole 16-byte vectors."""
    elems = num_kv_heads * head_dim
    if (elems * DTYPE_BYTES[dtype_name(dtype)]) % 16:
        raise UnsupportedShape(f"a KV row of {elems} elements is not a whole number of 16-byte vectors")
    return elems


def rms_norm_launch(rows: int, dtype: object, kind: str = "rms_norm") -> LaunchConfig:
    """One block of NORM_THREADS threads per row (a token's hidden state, or one head of it); ``kind``, one of
    NORM_KERNELS: the plain norm, the norm that also rotates the row (head rows of at most MAX_ROPE_DIM), the
    residual add followed by the norm, or a token's rows of the RoPE tables."""
    if rows < 1:
        raise ValueError(f"rms_norm launch needs rows >= 1, got {rows}")
    if kind not in NORM_KERNELS:
        raise ValueError(f"no norm kernel {kind!r}; choose from {NORM_KERNELS}")
    tag = DTYPE_TAGS[dtype_name(dtype)]
    return _checked(LaunchConfig(f"{kind}_{tag}", (rows, 1, 1), (NORM_THREADS, 1, 1), 0))


def silu_mul_launch(rows: int, inter: int, dtype: object) -> LaunchConfig:
    """One thread per output element, SILU_THREADS a block."""
    if rows < 1 or inter < 1:
        raise ValueError(f"silu_mul launch needs rows, inter >= 1, got {rows}, {inter}")
    tag = DTYPE_TAGS[dtype_name(dtype)]
    blocks = math.ceil(rows * inter / SILU_THREADS)
    return _checked(LaunchConfig(f"silu_mul_{tag}", (blocks, 1, 1), (SILU_THREADS, 1, 1), 0))


def widen_int4_launch(n: int, k: int, dtype: object) -> LaunchConfig:
    """One thread per stored byte of an (N, K) INT4 weight (two weights), WIDEN_THREADS a block."""
    if n < 1 or k < 1:
        raise ValueError(f"widen_int4 launch needs N, K >= 1, got {n}, {k}")
    tag = DTYPE_TAGS[dtype_name(dtype)]
    blocks = math.ceil(n * ((k + 1) // 2) / WIDEN_THREADS)
    return _checked(LaunchConfig(f"widen_int4_{tag}", (blocks, 1, 1), (WIDEN_THREADS, 1, 1), 0))


def _checked(cfg: LaunchConfig) -> LaunchConfig:
    if any(g < 1 for g in cfg.grid) or cfg.grid[1] > 65535 or cfg.grid[2] > 65535 or cfg.grid[0] > 2**31 - 1:
        raise ValueError(f"{cfg.kernel}: grid {cfg.grid} out of range")
    if cfg.shared_bytes > MAX_DYNAMIC_SHARED_BYTES:
        raise ValueError(f"{cfg.kernel}: {cfg.shared_bytes} B dynamic shared memory exceeds {MAX_DYNAMIC_SHARED_BYTES}")
    return cfg
