"""Copies of a checkpoint with its linear weights stored the ways published quantized checkpoints store them, for
the loader's tests and the quantization benchmark: FP8 with scales (Qwen's ``-FP8`` layout or llm-compressor's),
4- or 8-bit integers written by compressed-tensors, AutoAWQ's GEMM layout, GPTQ's own format. Each is written
from a float checkpoint (:mod:`support.checkpoints`), so what it should load to is known exactly.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from support.checkpoints import write_json


def fp8_copy(
    src: Path,
    dst: Path,
    block: tuple[int, int] | None,
    scale_dtype: torch.dtype = torch.float32,
    activation_scales: bool = False,
    compressed_tensors: str | None = None,
) -> Path:
    """A copy of checkpoint ``src`` in ``dst`` with its linear weights stored in FP8.

    Every 2-D ``.weight`` other than the embedding tables and the LM head (the linear layers, what FP8
    conversion converts) becomes float8_e4m3fn with a scale per block of weights: the block's largest
    magnitude / 448 (e4m3's largest), as a power of two above it for ``float8_e8m0fnu`` scales. Blocks that
    do not divide a dimension leave a partial last block. ``activation_scales`` adds the ``input_scale`` a
    static activation scheme stores.

    Layout: Qwen's ``-FP8`` one (``quant_method: fp8``, ``weight_scale_inv``, ``block`` (rows, columns) or
    one scale per tensor with None), or with ``compressed_tensors`` set to a strategy (``tensor``,
    ``channel``, ``group``: blocks of (1, ``block[1]``), ``block``: of ``block``) llm-compressor's
    float-quantized one (``quant_method: compressed-tensors``, ``weight_scale``).
    """
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for key, w in tensors.items():
        if not _converted(key, w):
            out[key] = w
            continue
        n, k = w.shape
        strategy = compressed_tensors or ("block" if block else "tensor")
        bn, bk = fp8_covered(strategy, block, (n, k))
        grid = (-(-n // bn), -(-k // bk))
        padded = torch.nn.functional.pad(w.float(), (0, grid[1] * bk - k, 0, grid[0] * bn - n))
        blocks = padded.view(grid[0], bn, grid[1], bk)
        scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp_min(2.0**-30)  # (grid rows, grid columns)
        if scale_dtype == torch.float8_e8m0fnu:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        scale = scale.to(scale_dtype)
        q = (blocks / scale.float()[:, None, :, None]).clamp(-448, 448).view(padded.shape)[:n, :k]
        out[key] = q.to(torch.float8_e4m3fn)
        if strategy == "tensor":
            scale = scale.reshape((1,) if compressed_tensors else ())
        out[key + ("_scale" if compressed_tensors else "_scale_inv")] = scale
        if activation_scales:
            out[key.removesuffix(".weight") + ".input_scale"] = torch.ones((), dtype=torch.float32)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = (
        _compressed_tensors_config(compressed_tensors, block, activation_scales)
        if compressed_tensors
        else {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "static" if activation_scales else "dynamic",
            "weight_block_size": list(block) if block else None,
            "modules_to_not_convert": ["lm_head"],
            **({"scale_fmt": "ue8m0"} if scale_dtype == torch.float8_e8m0fnu else {}),
        }
    )
    write_json(dst / "config.json", config)
    return dst


def int_copy(
    src: Path,
    dst: Path,
    bits: int = 4,
    strategy: str = "group",
    group_size: int | None = 32,
    symmetric: bool = True,
    fmt: str = "pack-quantized",
    vision: bool = True,
    head: bool = False,
) -> Path:
    """A copy of checkpoint ``src`` in ``dst`` with its linear weights stored as ``bits``-bit integers the way
    llm-compressor saves them (a W4A16 / W4A16_ASYM / W8A16-like scheme): the scales and zero points from
    compressed-tensors' own ``calculate_qparams`` over each group's min and max (round to nearest, as its
    ``minmax`` observer), the stored tensors from its own compressor for ``fmt`` (``pack-quantized`` or
    ``int-quantized``), so the files are the reference library's. Scales in the weights' dtype; the linear
    layers of :func:`fp8_copy` are converted, and with ``head`` the LM head (else ``ignore: [lm_head]``); without
    ``vision`` the vision tower stays too (``re:.*visual.*``, as the Qwen-VL recipes of llm-compressor leave it)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    args = QuantizationArgs(
        num_bits=bits,
        type="int",
        symmetric=symmetric,
        strategy=strategy,
        group_size=group_size if strategy == "group" else None,
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))  # rewritten below
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for key, w in tensors.items():
        wanted = _converted(key, w) or (head and key == "lm_head.weight")
        if not wanted or (not vision and "visual" in key):
            out[key] = w
            continue
        n, k = w.shape
        cols = group_size if strategy == "group" else k
        groups = w.float().view(n, k // cols, cols)  # compressed-tensors takes only groups that divide K
        lo, hi = groups.amin(dim=2), groups.amax(dim=2)  # (n, groups)
        if strategy == "tensor":
            lo, hi = lo.amin().reshape(1), hi.amax().reshape(1)
        scale, zero = calculate_qparams(lo, hi, args)
        state = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zero.to(torch.int8)}
        module = key.removesuffix(".weight")
        out.update({f"{module}.{name}": t.contiguous() for name, t in compressor.compress(state, scheme).items()})
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    spec = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=fmt,
        quantization_status="compressed",
        ignore=([] if head else ["lm_head"]) + ([] if vision else ["re:.*visual.*"]),
    )
    config["quantization_config"] = json.loads(spec.model_dump_json())
    write_json(dst / "config.json", config)
    return dst


# AutoAWQ's GEMM packing: bits 4i .. 4i + 3 of a word hold output 8c + AWQ_ORDER[i] of its 8 (AutoAWQ's
# ``order_map``); written here from AutoAWQ's description, independently of the node's reader.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def awq_quantize(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ's round-to-nearest with zero points for a weight ``w`` (N, K), groups of ``group_size`` inputs that
    divide K (its ``pseudo_quantize_tensor`` without the activation-aware search): (u (N, K) int64 in 0..15,
    z (N, groups) int64 in 0..15, s (N, groups) fp16), ``w ~ (u - z) * s``."""
    n, k = w.shape
    groups = w.float().view(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    s = ((hi - lo).clamp_min(1e-5) / 15).to(torch.float16)
    z = (-torch.round(lo / s.float())).clamp(0, 15)
    u = (torch.round(groups / s.float()[..., None]) + z[..., None]).clamp(0, 15)
    return u.view(n, k).long(), z.long(), s


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """(R, C) values in 0..15 -> (R, C / 8) int32 words of 8 consecutive columns each, in AWQ_ORDER."""
    r, c = values.shape
    v = values.long().view(r, c // 8, 8)
    words = torch.zeros(r, c // 8, dtype=torch.int64)
    for i, column in enumerate(AWQ_ORDER):
        words |= v[..., column] << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


def awq_copy(src: Path, dst: Path, group_size: int = 32) -> Path:
    """A copy of checkpoint ``src`` (fp16) in ``dst`` with its text decoder's linear weights stored as AutoAWQ's
    GEMM layout saves them: ``<module>.qweight`` int32 (K, N / 8) and ``qzeros`` (groups, N / 8) packed along
    the outputs (:func:`awq_pack`), ``scales`` fp16 (groups, N), from :func:`awq_quantize`; the vision tower and
    the LM head stay in float (``modules_to_not_convert: [visual]``, as AutoAWQ leaves a VL model's)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for key, w in load_file(str(src / "model.safetensors")).items():
        if not _converted(key, w) or "visual" in key:
            out[key] = w
            continue
        u, z, s = awq_quantize(w, group_size)
        module = key.removesuffix(".weight")
        out[f"{module}.qweight"] = awq_pack(u.t().contiguous())
        out[f"{module}.qzeros"] = awq_pack(z.t().contiguous())
        out[f"{module}.scales"] = s.t().contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                     "zero_point": True, "version": "gemm", "backend": "autoawq",
                                     "modules_to_not_convert": ["visual"]}  # fmt: skip
    write_json(dst / "config.json", config)
    return dst


def gptq_groups(k: int, group_size: int | None, desc_act: bool, seed: int = 0) -> torch.Tensor:
    """GPTQ's g_idx (K,) int32: k // group_size, or with ``desc_act`` the group of each input's rank in a random
    order (GPTQ quantizes the inputs in order of their activations' size and groups them in that order)."""
    g = group_size or k
    if not desc_act:
        return (torch.arange(k) // g).to(torch.int32)
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).to(torch.int32)
    return g_idx


def gptq_quantize(w: torch.Tensor, g_idx: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's quantizer without the error feedback (round to nearest) for a weight ``w`` (N, K) and its groups
    ``g_idx``: each group's range widened to hold 0, symmetric (zero point 8) or not, as GPTQ's ``Quantizer``
    finds its parameters. Returns (u (N, K) int64 in 0..15, z (N, groups) int64, s (N, groups) fp16)."""
    n, k = w.shape
    w = w.float()
    groups = int(g_idx.max()) + 1
    lo = torch.stack([w[:, g_idx == g].amin(dim=1) for g in range(groups)], dim=1).clamp(max=0)  # (N, groups)
    hi = torch.stack([w[:, g_idx == g].amax(dim=1) for g in range(groups)], dim=1).clamp(min=0)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    s = ((hi - lo) / 15).clamp_min(1e-8).to(torch.float16)
    z = torch.full_like(lo, 8.0) if sym else torch.round(-lo / s.float())
    index = g_idx.long()
    u = (torch.round(w / s.float()[:, index]) + z[:, index]).clamp(0, 15)
    return u.long(), z.long(), s


def _pack_fields(values: torch.Tensor) -> torch.Tensor:
    """(R, C) values in 0..15 -> (R, C / 8) int32 words, column 8c + j at bits 4j of word c."""
    r, c = values.shape
    fields = values.long().view(r, c // 8, 8) << (4 * torch.arange(8))
    words = fields.sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


def gptq_copy(
    src: Path, dst: Path, group_size: int | None = 32, sym: bool = True, desc_act: bool = False, v1: bool = True
) -> Path:
    """A copy of checkpoint ``src`` in ``dst`` with its text decoder's linear weights stored in GPTQ's own format
    as GPTQModel and AutoGPTQ save it: ``qweight`` int32 (K / 8, N), 8 inputs of one output a word; ``qzeros``
    int32 (groups, N / 8), 8 outputs a word, in ``v1`` (``checkpoint_format: gptq``) 0x11111111 less per word
    (GPTQModel's conversion to the original format); ``scales`` fp16 (groups, N); ``g_idx`` (:func:`gptq_groups`).
    Written here from the format's description, independently of the node's reader; ``group_size`` None is one
    group a row (``-1``). The vision tower and the LM head stay in float."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for index, (key, w) in enumerate(load_file(str(src / "model.safetensors")).items()):
        if not _converted(key, w) or "visual" in key:
            out[key] = w
            continue
        g_idx = gptq_groups(w.shape[1], group_size, desc_act, seed=index)  # each tensor's own order
        u, z, s = gptq_quantize(w, g_idx, sym)
        module = key.removesuffix(".weight")
        out[f"{module}.qweight"] = _pack_fields(u).t().contiguous()  # (N, K / 8) words of 8 inputs -> (K / 8, N)
        zeros = _pack_fields(z.t().contiguous())  # (groups, N / 8)
        if v1:
            wide = (zeros.long() - 0x11111111) & 0xFFFFFFFF
            zeros = torch.where(wide >= 2**31, wide - 2**32, wide).to(torch.int32)
        out[f"{module}.qzeros"] = zeros
        out[f"{module}.scales"] = s.t().contiguous()
        out[f"{module}.g_idx"] = g_idx
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size or -1,
                                     "desc_act": desc_act, "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2",
                                     "true_sequential": True, "static_groups": False, "damp_percent": 0.01}  # fmt: skip
    write_json(dst / "config.json", config)
    return dst


def rewrite_tensors(ckpt: Path, change: Callable[[dict[str, torch.Tensor]], object]) -> None:
    """Apply ``change(tensors)`` to a single-file checkpoint's tensors in place (tests of damaged files)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})


def edit_config(ckpt: Path, change: Callable[[dict], object]) -> None:
    """Apply ``change(config)`` to a checkpoint's config.json in place."""
    config = json.loads((ckpt / "config.json").read_text())
    change(config)
    write_json(ckpt / "config.json", config)


def _converted(key: str, w: torch.Tensor) -> bool:
    """Whether a quantizing tool converts checkpoint tensor ``key``: the linear layers' weights (2-D ``.weight``
    other than the embedding tables and the LM head)."""
    return w.ndim == 2 and key.endswith(".weight") and "embed" not in key and not key.startswith("lm_head")


def fp8_covered(strategy: str, block: tuple[int, int] | None, shape: tuple[int, int]) -> tuple[int, int]:
    """(rows, columns) one scale covers in a weight of ``shape`` written by :func:`fp8_copy` with ``strategy``
    (``tensor``, ``channel``, ``group``: (1, ``block[1]``), ``block``: ``block``)."""
    n, k = shape
    return {"tensor": (n, k), "channel": (1, k), "group": (1, block[1] if block else k)}.get(strategy, block)


def _compressed_tensors_config(strategy: str, block: tuple[int, int] | None, static: bool) -> dict:
    """llm-compressor's quantization_config for FP8 weights with ``strategy`` (an FP8_DYNAMIC-like scheme)."""
    weights = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": False,
        "strategy": strategy,
        "group_size": block[1] if strategy == "group" and block else None,
        "block_structure": list(block) if strategy == "block" and block else None,
        "observer": "minmax",
    }
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "observer": None,
                   "strategy": "tensor" if static else "token", "dynamic": not static}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }
