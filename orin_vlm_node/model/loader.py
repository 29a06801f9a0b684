"""Load an HF-format Qwen3-VL directory into :class:`Qwen3VLModel`, streaming tensor by tensor.

Why streamed: on a Jetson the CPU and GPU share one memory, so building the model with initialised
weights and then loading a state dict would need twice the model size. Here the module tree is built
on the meta device (no storage), each parameter is allocated once, empty, in the target dtype on the
target device, and every checkpoint tensor is read from its safetensors file and copied into place
(cast on the way). Peak memory is about the model size plus the largest single tensor.

All headers are checked before any data is read: missing/unexpected keys, shape mismatches, missing
shard files, pickle-only checkpoints and FP8 weights without a fitting scale raise :class:`CheckpointError`
naming the files and keys. FP8 checkpoints (:mod:`.fp8_weights`) are widened to ``dtype`` tensor by tensor.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .config import ModelConfig
from .dtypes import resolve_dtype
from .errors import CheckpointError
from .fp8_weights import ACTIVATION_SCALE_SUFFIXES, WEIGHT_DTYPE, Fp8Weights, Fp8Widener
from .quant import QuantizedLinear, WeightQuant, weight_bytes
from .qwen3_vl import Qwen3VLModel
from .text import FusedLinear

logger = logging.getLogger("orin_vlm_node.model")

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_MAX_LISTED = 8  # keys named in one error message
# A progress line at most this often: an 8B checkpoint from a Jetson's eMMC takes a minute, a small one
# loads before the first line would be worth reading.
PROGRESS_INTERVAL_S = 2.0


def load_model(
    path: str | Path, dtype: torch.dtype | str = torch.float32, device="cpu", quant: WeightQuant | None = None
) -> Qwen3VLModel:
    """Build the model for ``path`` (config.json + safetensors) in ``dtype`` on ``device``; with ``quant``
    the text decoder's projections are stored quantized, each as soon as its checkpoint matrices are in
    (so the float copy of the whole decoder never exists)."""
    t0 = time.perf_counter()
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: model directory does not exist")
    target = resolve_dtype(dtype)
    config = ModelConfig.from_dir(root)
    files = weight_files(root)
    with torch.device("meta"):
        model = Qwen3VLModel(config)
    expected = {name: tuple(view.shape) for name, view in checkpoint_views(model).items()}
    plan, scale_keys = _plan(files, expected, config.tie_word_embeddings, config.fp8)
    scales = _read(scale_keys)  # parameter name -> scale of its FP8 weight (small: one number per block)
    widener = Fp8Widener(config.fp8, torch.device(device)) if config.fp8 else None
    quantizer = _QuantizeOnLoad(model, quant, target, torch.device(device)) if quant and quant.mode != "none" else None
    _materialize(model, target, torch.device(device), skip=quantizer.deferred if quantizer else frozenset())
    views = checkpoint_views(model)
    total = sum(views[name].numel() for _, name in plan.values()) * torch.empty((), dtype=target).element_size()
    logger.info(
        "loading %s: %d tensors from %d file(s), %.1f MB as %s on %s%s%s",
        root,
        len(plan),
        len(files),
        total / 1e6,
        str(target).replace("torch.", ""),
        device,
        f", {len(scales)} of them widened from {config.fp8.describe()}" if config.fp8 else "",
        f", decoder projections as {quant.mode}{', LM head as ' + quant.head.mode if quant.head else ''}"
        if quantizer
        else "",
    )
    done_bytes = 0
    last_report = t0
    for file in files:
        keys = [(key, name) for key, (f, name) in plan.items() if f == file]
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key, name in keys:
                try:
                    tensor = handle.get_tensor(key)
                except Exception as exc:  # truncated/corrupt data section
                    raise CheckpointError(f"{file}: cannot read tensor {key} ({exc})") from exc
                if not tensor.is_floating_point():
                    raise CheckpointError(f"{file.name}: tensor {key} has non-float dtype {tensor.dtype}")
                view = quantizer.target(name) if quantizer and name in quantizer.owner else views[name]
                if name in scales:
                    widener.widen_into(view, tensor, scales.pop(name))
                else:
                    view.copy_(tensor)
                done_bytes += view.numel() * view.element_size()
                del tensor, view
                if quantizer and name in quantizer.owner:
                    quantizer.loaded(name)
                if time.perf_counter() - last_report >= PROGRESS_INTERVAL_S:
                    logger.info("  %3.0f%% (%s)", 100 * done_bytes / total, file.name)
                    last_report = time.perf_counter()
    if quantizer:
        quantizer.finish()
    del widener
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the working copies of widening and quantizing: on a Jetson, the robot's RAM
    model.init_buffers()
    model.eval()
    logger.info(
        "loaded %s in %.1f s (%.3f B parameters, weights %.1f MB)",
        root.name,
        time.perf_counter() - t0,
        model.num_parameters() / 1e9,
        weight_bytes(model) / 1e6,
    )
    return model


class _QuantizeOnLoad:
    """The decoder projections (and the LM head, ``WeightQuant.head``) quantized while the checkpoint streams in.

    Each projection's float weight is allocated when its first checkpoint matrix arrives (not up front),
    filled, quantized once all of its matrices are in, and dropped; so the float copy of only a few
    projections exists at any time. A head tied to the embedding table is quantized from the table once
    the checkpoint is in (:meth:`finish`); the table stays.
    """

    def __init__(self, model: Qwen3VLModel, quant: WeightQuant, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.dtype, self.device = model, dtype, device
        # module name -> (parent, attr, module, how it is stored)
        self.modules: dict[str, tuple[nn.Module, str, nn.Module, WeightQuant]] = {}
        self.owner: dict[str, str] = {}  # checkpoint view name -> module name
        self.remaining: dict[str, set[str]] = {}
        self.tied_head = quant.head if model.config.tie_word_embeddings else None
        inputs = []
        for i, layer in enumerate(model.language_model.layers):
            for sub, attr in layer.PROJECTIONS:
                parent = getattr(layer, sub)
                module = getattr(parent, attr)
                name = f"language_model.layers.{i}.{sub}.{attr}"
                parts = module.parts if isinstance(module, FusedLinear) else {attr: module.weight.shape[0]}
                views = {f"language_model.layers.{i}.{sub}.{part}.weight" for part in parts}
                self.modules[name] = (parent, attr, module, quant)
                self.remaining[name] = set(views)
                self.owner.update(dict.fromkeys(views, name))
                inputs.append(module.weight.shape[1])
        quant.check(tuple(inputs))
        if quant.head and not self.tied_head:
            self.modules["lm_head"] = (model, "lm_head", model.lm_head, quant.head)
            self.remaining["lm_head"] = {"lm_head.weight"}
            self.owner["lm_head.weight"] = "lm_head"
        self.deferred = frozenset(id(m.weight) for _, _, m, _ in self.modules.values())

    def target(self, view: str) -> torch.Tensor:
        """The tensor the checkpoint matrix ``view`` is copied into (its projection allocated if need be)."""
        _, _, module, _ = self.modules[self.owner[view]]
        if module.weight.is_meta:
            module.weight = nn.Parameter(
                torch.empty(module.weight.shape, dtype=self.dtype, device=self.device), requires_grad=False
            )
        if not isinstance(module, FusedLinear):
            return module.weight
        part = view.rsplit(".", 2)[-2]
        return module.weight[module.part_rows()[part]]

    def loaded(self, view: str) -> None:
        name = self.owner[view]
        self.remaining[name].discard(view)
        if not self.remaining[name]:
            parent, attr, module, quant = self.modules.pop(name)
            setattr(parent, attr, QuantizedLinear.from_weight(module.weight, quant))

    def finish(self) -> None:
        """After the last tensor: a tied head quantized from the embedding table (which stays as it is)."""
        if self.tied_head:
            self.model.lm_head = QuantizedLinear.from_weight(self.model.lm_head.weight, self.tied_head)


def weight_files(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint: ``model.safetensors`` or the shards of its index."""
    single = root / "model.safetensors"
    index = root / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        shards = [root / name for name in names]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard file(s) missing: {', '.join(missing)}")
        return shards
    others = sorted(root.glob("*.safetensors"))
    if others:
        return others
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{root}: only PyTorch pickle weights found ({', '.join(pickles[:_MAX_LISTED])}); they are refused "
            "because loading them can run arbitrary code. Convert them to safetensors (e.g. load with "
            "transformers and save_pretrained(..., safe_serialization=True))."
        )
    raise CheckpointError(f"{root}: no weights (expected model.safetensors or model.safetensors.index.json)")


def checkpoint_key_to_name(key: str) -> str:
    """Checkpoint key -> our parameter name; accepts the Qwen3-VL layout and older spellings.

    ``model.visual.*`` / ``visual.*`` -> ``visual.*``; ``model.language_model.*`` / ``model.*`` (pre-4.52
    layout) / ``language_model.model.*`` -> ``language_model.*``; ``lm_head.*`` and
    ``language_model.lm_head.*`` -> ``lm_head.*``.
    """
    for prefix, repl in (
        ("model.visual.", "visual."),
        ("model.language_model.", "language_model."),
        ("language_model.model.", "language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("visual.", "visual."),
        ("lm_head.", "lm_head."),
        ("model.", "language_model."),
    ):
        if key.startswith(prefix):
            return repl + key[len(prefix) :]
    return key


def name_to_checkpoint_key(name: str) -> str:
    """Our parameter name -> the key an HF Qwen3-VL checkpoint stores it under."""
    return name if name.startswith("lm_head.") else "model." + name


def checkpoint_views(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint provides, by parameter name (as :func:`checkpoint_key_to_name` gives it),
    as the tensor it is copied into: the parameter itself, or for a :class:`FusedLinear` the rows of its
    weight that one checkpoint matrix fills (``...self_attn.q_proj.weight`` -> rows of ``qkv_proj.weight``).
    Tied parameters appear once (under their first name)."""
    fused = {f"{name}.weight": (name, m) for name, m in model.named_modules() if isinstance(m, FusedLinear)}
    views: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if name not in fused:
            views[name] = param
            continue
        module_name, module = fused[name]
        parent = module_name.rpartition(".")[0]
        for part, rows in module.part_rows().items():
            views[f"{parent}.{part}.weight"] = param[rows]
    return views


def _plan(
    files: list[Path], expected: dict[str, tuple[int, ...]], tied: bool, fp8: Fp8Weights | None
) -> tuple[dict[str, tuple[Path, str]], dict[str, tuple[Path, str]]]:
    """(checkpoint key -> (file, parameter name), parameter name -> (file, key) of its FP8 scale), after
    checking every header against the model."""
    plan: dict[str, tuple[Path, str]] = {}
    seen: dict[str, str] = {}  # parameter name -> key that provides it
    unexpected: list[str] = []
    mismatched: list[str] = []
    stored_fp8: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # name -> (key, dtype, shape) of FP8 weights
    scales: dict[str, tuple[Path, str, str, tuple[int, ...]]] = {}  # parameter name -> (file, key, dtype, shape)
    for file in files:
        try:
            handle_ctx = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{file}: cannot open as safetensors ({exc})") from exc
        with handle_ctx as handle:
            for key in handle.keys():
                if fp8 and key.endswith(".weight" + fp8.scale_suffix):
                    meta = handle.get_slice(key)
                    owner = checkpoint_key_to_name(key.removesuffix(fp8.scale_suffix))
                    scales[owner] = (file, key, meta.get_dtype(), tuple(meta.get_shape()))
                    continue
                if fp8 and key.endswith(ACTIVATION_SCALE_SUFFIXES):
                    continue  # activations stay in the model's dtype (fp8_weights)
                name = checkpoint_key_to_name(key)
                if name not in expected:
                    if tied and name == "lm_head.weight":
                        continue  # tied: lm_head is embed_tokens; a saved copy is redundant
                    unexpected.append(f"{file.name}:{key}")
                    continue
                if name in seen:
                    raise CheckpointError(f"{file.name}: {key} duplicates {seen[name]} (both map to {name})")
                meta = handle.get_slice(key)
                shape = tuple(meta.get_shape())
                if meta.get_dtype().startswith("F8_"):
                    stored_fp8[name] = (key, meta.get_dtype(), shape)
                if shape != expected[name]:
                    mismatched.append(
                        f"{file.name}:{key} has shape {list(shape)}, config.json implies {list(expected[name])}"
                    )
                seen[name] = key
                plan[key] = (file, name)
    problems = _fp8_problems(stored_fp8, scales, fp8)
    unexpected += [f"{file.name}:{key}" for name, (file, key, _, _) in scales.items() if name not in stored_fp8]
    if mismatched:
        problems.append(f"shape mismatch: {_listing(mismatched)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    missing = [name_to_checkpoint_key(name) for name in expected if name not in seen]
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if problems:
        where = files[0].parent
        raise CheckpointError(f"{where}: checkpoint does not match config.json; " + "; ".join(problems))
    return plan, {name: (file, key) for name, (file, key, _, _) in scales.items()}


def _fp8_problems(
    stored: dict[str, tuple[str, str, tuple[int, ...]]],
    scales: dict[str, tuple[Path, str, str, tuple[int, ...]]],
    fp8: Fp8Weights | None,
) -> list[str]:
    """What keeps the FP8 weights ``stored`` (name -> (key, dtype, shape)) from being widened."""
    if not stored:
        return []
    if fp8 is None:
        keys = [key for key, _, _ in stored.values()]
        return [f"FP8 weights but config.json has no quantization_config with quant_method fp8: {_listing(keys)}"]
    found = []
    for name, (key, dtype, shape) in stored.items():
        scale = scales.get(name)
        why = (
            f"{key} is {dtype}; FP8 weights are read as {WEIGHT_DTYPE}"
            if dtype != WEIGHT_DTYPE
            else fp8.problem(key, shape, scale[2:] if scale else None)
        )
        if why:
            found.append(why)
    return [f"FP8 weights: {_listing(found)}"] if found else []


def _read(keys: dict[str, tuple[Path, str]]) -> dict[str, torch.Tensor]:
    """name -> the tensor stored under (file, key), every file opened once."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted({file for file, _ in keys.values()}):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            tensors.update({name: handle.get_tensor(key) for name, (f, key) in keys.items() if f == file})
    return tensors


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device, skip: frozenset[int]) -> None:
    """Replace meta parameters/buffers by uninitialised storage, keeping shared (tied) parameters shared;
    parameters whose id is in ``skip`` stay on meta (allocated later by whoever deferred them)."""
    memo: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or id(param) in skip:
                continue
            if id(param) not in memo:
                memo[id(param)] = nn.Parameter(
                    torch.empty(param.shape, dtype=dtype, device=device), requires_grad=False
                )
            module._parameters[name] = memo[id(param)]
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
