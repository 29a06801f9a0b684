"""Random-weight Qwen3-VL checkpoints written by transformers itself, for tests and benchmarks.

Why: no real model can be downloaded, so the reference is ``transformers``' ``Qwen3VLForConditionalGeneration``
built from a ``Qwen3VLConfig`` and saved with ``save_pretrained`` -- the exact file layout our loader must
read, loaded by both our engine and transformers. Weights are perturbed away from HF's init (norm weights
!= 1, biases != 0, weights ~ 1/sqrt(fan_in)) so every term of the math matters and logits are decisive
enough for greedy parity.

Token ids follow the tiny tokenizer (:mod:`support.tokenizer`): ``<|endoftext|>``=0, ``<|im_start|>``=1,
``<|im_end|>``=2, ``<|vision_start|>``=3, ``<|vision_end|>``=4, ``<|vision_pad|>``=5, ``<|image_pad|>``=6,
``<|video_pad|>``=7.

* ``make_tiny_checkpoint(tmp_path / "ckpt", layers=2, tie=False)``, or ``cached_tiny_checkpoint(**kwargs)``
  (one build per distinct kwargs per process): the parity tests' tiny shapes (vocab 1024).
* :func:`kv_shape_checkpoint`: a small model whose *attention* has the 2B's KV shape (16 q heads, 8 kv
  heads, head_dim 128) with a narrow hidden size and few layers: paging overhead lives in attention, so
  this keeps attention's share of a step realistic at a fraction of the 2B's cost. It is talkative (see
  :func:`make_tiny_checkpoint`): the paged benchmark steps engines one streamed token at a time.
* :func:`fp8_copy`: a checkpoint's linear weights rewritten in FP8 with scales, in Qwen's ``-FP8`` layout or
  llm-compressor's.
* :func:`int_copy`: the same with 4- or 8-bit integer weights, written by compressed-tensors (llm-compressor's
  W4A16-like layouts).
* :func:`awq_copy`: the same with 4-bit weights in AutoAWQ's GEMM layout (``quant_method: awq``).
* :func:`gptq_copy`: the same in GPTQ's own format (``quant_method: gptq``, v1 or v2 zero points, with or
  without activation order).
* :func:`big_checkpoint`: every text and vision dimension of a real config (e.g. Qwen3-VL-2B: vocab 151936,
  28 layers, 24-layer vision tower), stored bf16 (~4.3 GB).
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from support.tokenizer import build_tiny_tokenizer, write_tiny_tokenizer

ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, VISION_PAD, IMAGE_PAD, VIDEO_PAD = range(8)
PATCH_DIM = 3 * 2 * 16 * 16


def default_mrope_section(head_dim: int) -> list[int]:
    """Qwen3-VL's [24, 20, 20] scaled to ``head_dim/2`` frequencies (e.g. [6, 5, 5] for head_dim 32)."""
    hw = round(head_dim / 2 * 20 / 64)
    return [head_dim // 2 - 2 * hw, hw, hw]


def make_tiny_checkpoint(
    path: str | Path,
    *,
    seed: int = 0,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    hidden: int = 64,
    intermediate: int = 128,
    layers: int = 3,
    deepstack: Sequence[int] = (0, 1),
    tie: bool = True,
    vocab_size: int = 1024,
    rope_theta: float = 5_000_000.0,
    mrope_section: Sequence[int] | None = None,
    vision_depth: int = 3,
    vision_hidden: int = 64,
    vision_heads: int = 4,
    vision_intermediate: int = 128,
    num_position_embeddings: int = 64,
    dtype: torch.dtype = torch.float32,
    legacy_rope_keys: bool = False,
    with_tokenizer: bool = True,
    device: str = "cpu",
    talkative: bool = False,
) -> Path:
    """Build, perturb and ``save_pretrained`` a tiny Qwen3-VL; return the directory.

    ``legacy_rope_keys`` rewrites config.json's text RoPE settings in the 4.57 spelling
    (``rope_theta`` + ``rope_scaling``) instead of 5.x ``rope_parameters``. ``device``: where the weights
    are made ("cuda" builds a 2B-shape checkpoint in seconds instead of minutes; the values then differ
    from a CPU build with the same seed). ``talkative`` (untied, with the tiny tokenizer): the LM head rows
    of every id that does not decode on its own to whole characters are zero (:func:`mute_ids`), so their
    logit is 0 while the largest of the others is positive: greedy answers never end on their own (long
    answers through interfaces without ``ignore_eos``, e.g. the ROS node in benchmarks) and every token
    completes text, so the engine streams one delta per token (benchmarks that take turns token by token).
    """
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    out = Path(path)
    section = list(mrope_section) if mrope_section is not None else default_mrope_section(head_dim)
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "num_hidden_layers": layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": rope_theta,
                "mrope_section": section,
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": tie,
            "bos_token_id": ENDOFTEXT,
            "eos_token_id": IM_END,
            "pad_token_id": ENDOFTEXT,
        },
        vision_config={
            "depth": vision_depth,
            "hidden_size": vision_hidden,
            "intermediate_size": vision_intermediate,
            "num_heads": vision_heads,
            "out_hidden_size": hidden,
            "num_position_embeddings": num_position_embeddings,
            "deepstack_visual_indexes": list(deepstack),
            "patch_size": 16,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
        },
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration(config).eval()
    _perturb(model, seed)
    if talkative:
        if tie or not with_tokenizer:
            raise ValueError("talkative needs an untied LM head (zeroing a tied row changes the embedding) "
                             "and the tiny tokenizer (whose tokens it mutes)")  # fmt: skip
        with torch.no_grad():
            model.lm_head.weight[mute_ids(vocab_size)] = 0.0
    model.to(dtype)
    model.save_pretrained(out)
    if legacy_rope_keys:
        _rewrite_rope_legacy(out / "config.json")
    _write_json(
        out / "preprocessor_config.json",
        {
            "image_processor_type": "Qwen2VLImageProcessorFast",
            "processor_class": "Qwen3VLProcessor",
            "patch_size": 16,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_convert_rgb": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "do_resize": True,
            "resample": 3,
            "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 64},
        },
    )
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ENDOFTEXT,
            "pad_token_id": ENDOFTEXT,
            "eos_token_id": [IM_END, ENDOFTEXT],
            "do_sample": True,
            "temperature": 0.7,
            "top_p": 0.8,
            "top_k": 20,
        },
    )
    if with_tokenizer:
        write_tiny_tokenizer(out)
    return out


def mute_ids(vocab_size: int) -> list[int]:
    """Ids below ``vocab_size`` a talkative model never says: the special tokens (EOS among them), ids the
    tiny tokenizer does not have (they decode to nothing) and tokens holding part of a UTF-8 character
    (they decode to U+FFFD alone; a random model's greedy text can repeat one of them for a whole answer,
    which the engine holds back as an incomplete character until the answer ends)."""
    tokenizer = build_tiny_tokenizer()

    def whole(text: str) -> bool:
        return bool(text) and "\ufffd" not in text

    return [i for i in range(vocab_size) if not whole(tokenizer.decode([i], skip_special_tokens=True))]


def kv_shape_checkpoint(out: Path, num_layers: int) -> Path:
    """The 2B's attention shape on a narrow, shallow model (see the module docstring)."""
    return make_tiny_checkpoint(
        out, num_heads=16, num_kv_heads=8, head_dim=128, hidden=256, intermediate=512, layers=num_layers,
        deepstack=(0,), vision_depth=1, tie=False, talkative=True,
    )  # fmt: skip


def big_checkpoint(out: Path, config: dict, device: str = "cpu") -> Path:
    """Every dimension of an HF Qwen3-VL ``config`` (the parsed config.json), random weights, bf16 on disk."""
    text, vision = config["text_config"], config["vision_config"]
    if vision["out_hidden_size"] != text["hidden_size"]:
        raise ValueError("config: vision out_hidden_size differs from the text hidden_size")
    return make_tiny_checkpoint(
        out,
        num_heads=text["num_attention_heads"],
        num_kv_heads=text["num_key_value_heads"],
        head_dim=text["head_dim"],
        hidden=text["hidden_size"],
        intermediate=text["intermediate_size"],
        layers=text["num_hidden_layers"],
        deepstack=tuple(vision["deepstack_visual_indexes"]),
        tie=bool(config.get("tie_word_embeddings", True)),
        vocab_size=text["vocab_size"],
        rope_theta=float(text.get("rope_theta", 5_000_000.0)),
        mrope_section=text.get("rope_scaling", {}).get("mrope_section"),
        vision_depth=vision["depth"],
        vision_hidden=vision["hidden_size"],
        vision_heads=vision["num_heads"],
        vision_intermediate=vision["intermediate_size"],
        num_position_embeddings=vision["num_position_embeddings"],
        dtype=torch.bfloat16,
        device=device,
    )


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
    _write_json(dst / "config.json", config)
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
    _write_json(dst / "config.json", config)
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
    _write_json(dst / "config.json", config)
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
    _write_json(dst / "config.json", config)
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
    _write_json(ckpt / "config.json", config)


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


@functools.cache
def _cached(items: tuple) -> Path:
    kwargs = dict(items)
    name = "ckpt_" + "_".join(f"{k}-{v}" for k, v in items).replace(" ", "").replace("torch.", "")
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:180]
    return make_tiny_checkpoint(_session_dir() / name, **kwargs)


def cached_tiny_checkpoint(**kwargs) -> Path:
    """Like :func:`make_tiny_checkpoint` under a per-process temp dir, built once per distinct kwargs.

    Callers must not modify the returned directory (copy it first).
    """
    items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()))
    return _cached(items)


@functools.lru_cache(maxsize=1)
def _session_dir() -> Path:
    root = Path(tempfile.mkdtemp(prefix="tiny_qwen3vl_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def random_pixel_values(grid_thw: Sequence[Sequence[int]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (N, 1536) fp32 patches in [-1, 1] and the (n, 3) long grid for images of these patch grids."""
    grid = torch.tensor([list(g) for g in grid_thw], dtype=torch.long)
    n = int(grid.prod(-1).sum())
    gen = torch.Generator().manual_seed(seed)
    return torch.rand((n, PATCH_DIM), generator=gen) * 2 - 1, grid


def image_prompt(text_ids: Sequence[Sequence[int]], grid_thw: Sequence[Sequence[int]], merge: int = 2) -> list[int]:
    """ChatML-like prompt: text chunk, image, text chunk, image, ..., text chunk, generation prompt.

    ``text_ids`` has one more entry than ``grid_thw``; each image becomes
    ``<|vision_start|> + t*h*w/merge^2 x <|image_pad|> + <|vision_end|>``.
    """
    if len(text_ids) != len(grid_thw) + 1:
        raise ValueError("need one more text chunk than images")
    ids = [IM_START, 20, 21]
    for chunk, (t, h, w) in zip(text_ids[:-1], grid_thw, strict=True):
        ids += list(chunk) + [VISION_START] + [IMAGE_PAD] * (t * h * w // (merge * merge)) + [VISION_END]
    ids += list(text_ids[-1]) + [IM_END, 22, IM_START, 23, 24]
    return ids


def mm_token_type_ids(ids: Sequence[int]) -> torch.Tensor:
    """(1, L) int: 1 at image pads, 0 elsewhere (what transformers 5.x needs next to image_grid_thw)."""
    return torch.tensor([[1 if i == IMAGE_PAD else 0 for i in ids]], dtype=torch.int32)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32, device=device)
            if p.dim() == 1 and "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / math.sqrt(p[0].numel()))


def _rewrite_rope_legacy(config_file: Path) -> None:
    data = json.loads(config_file.read_text())
    text = data["text_config"]
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = rope
    _write_json(config_file, data)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
