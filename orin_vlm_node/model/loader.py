"""Load an HF-format Qwen3-VL directory into :class:`Qwen3VLModel`, streaming tensor by tensor.

Why streamed: on a Jetson the CPU and GPU share one memory, so building the model with initialised
weights and then loading a state dict would need twice the model size. Here the module tree is built
on the meta device (no storage), each parameter is allocated once, empty, in the target dtype on the
target device, and every checkpoint tensor is read from its safetensors file and copied into place
(cast on the way). Peak memory is about the model size plus the largest single tensor.

All headers are checked before any data is read: missing/unexpected keys, shape mismatches, missing
shard files, pickle-only checkpoints and quantized weights without fitting scales raise :class:`CheckpointError`
naming the files and keys. Weights stored quantized (:mod:`.stored_format`) are widened to ``dtype`` tensor
by tensor (FP8: :mod:`.fp8_weights`), or kept as stored where ``weight_quant`` asks for their integer format
(:mod:`.int_weights`, :mod:`.awq_weights`, :mod:`.gptq_weights`); a weight's scales are read with it, from
whichever shard holds them.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from .config import ModelConfig
from .dtypes import resolve_dtype
from .errors import CheckpointError
from .int_weights import PACKED_SUFFIX
from .quant import QuantizedLinear, WeightQuant, weight_bytes
from .qwen3_vl import Qwen3VLModel
from .stored_format import INTEGER_FORMATS, StoredFormat
from .text import FusedLinear

logger = logging.getLogger("orin_vlm_node.model")

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_MAX_LISTED = 8  # keys named in one error message
# A progress line at most this often: an 8B checkpoint from a Jetson's eMMC takes a minute, a small one
# loads before the first line would be worth reading.
PROGRESS_INTERVAL_S = 2.0
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names; a weight in another dtype is stored quantized


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
    fmt = config.weight_format
    files = weight_files(root)
    with torch.device("meta"):
        model = Qwen3VLModel(config)
    expected = {name: tuple(view.shape) for name, view in checkpoint_views(model).items()}
    plan, companions = _plan(files, expected, config.tie_word_embeddings, fmt)
    quantizer = (
        _QuantizeOnLoad(model, quant, target, torch.device(device), fmt, frozenset(companions))
        if quant and quant.mode != "none"
        else None
    )
    _materialize(model, target, torch.device(device), skip=quantizer.deferred if quantizer else frozenset())
    views = checkpoint_views(model)
    element = torch.empty((), dtype=target).element_size()
    total = sum(views[name].numel() for _, name in plan.values()) * element
    kept = quantizer.kept_views() if quantizer else set()
    logger.info(
        "loading %s: %d tensors from %d file(s), %.1f MB as %s on %s%s%s",
        root,
        len(plan),
        len(files),
        total / 1e6,
        str(target).replace("torch.", ""),
        device,
        f", {len(companions)} of them stored as {fmt.describe()}, {len(kept)} kept as stored" if fmt else "",
        f", decoder projections as {quant.mode}{', LM head as ' + quant.head.mode if quant.head else ''}"
        if quantizer
        else "",
    )
    _warn_widened_integers(fmt, set(companions) - kept, quant, target)
    widener = fmt.widener(torch.device(device)) if fmt else None
    done_bytes = 0
    last_report = t0
    with ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(str(file), framework="pt", device="cpu")) for file in files}
        for file in files:
            for key, name in [(key, name) for key, (f, name) in plan.items() if f == file]:
                tensor = _get(handles, file, key)
                parts = {role: _get(handles, *where) for role, where in companions.get(name, {}).items()}
                if name in kept:
                    quantizer.store(name, tensor, parts)
                elif quantizer and name in quantizer.owner:
                    quantizer.quantize(name, _widened(widener, tensor, parts, views[name].shape, target, device))
                elif parts:
                    widener.widen_into(views[name], tensor, **parts)
                else:
                    views[name].copy_(tensor)
                done_bytes += views[name].numel() * element
                del tensor, parts
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


def _widened(
    widener: Any,
    tensor: torch.Tensor,
    parts: dict[str, torch.Tensor],
    shape: torch.Size,
    dtype: torch.dtype,
    device: str | torch.device,
) -> torch.Tensor:
    """A checkpoint matrix of ``shape``, for quantizing: the stored tensor as it is (the quantizer moves and casts
    it a piece at a time), or one stored with scales widened into ``dtype`` on ``device``."""
    if not parts:
        return tensor
    out = torch.empty(shape, dtype=dtype, device=device)
    widener.widen_into(out, tensor, **parts)
    return out


def _get(handles: dict[Path, Any], file: Path, key: str) -> torch.Tensor:
    """Tensor ``key`` of ``file`` (open in ``handles``); CheckpointError when its data cannot be read."""
    try:
        return handles[file].get_tensor(key)
    except Exception as exc:  # truncated/corrupt data section
        raise CheckpointError(f"{file}: cannot read tensor {key} ({exc})") from exc


def _warn_widened_integers(
    fmt: StoredFormat | None, widened: set[str], quant: WeightQuant | None, dtype: torch.dtype
) -> None:
    """A warning when integer decoder weights are widened: the robot then holds (and reads every token) two to
    four times the bytes it downloaded, or quantizes them a second time."""
    decoder = [name for name in widened if name.startswith("language_model.layers.")]
    if not isinstance(fmt, INTEGER_FORMATS) or not decoder:
        return
    mode = quant.mode if quant else "none"
    logger.warning(
        "%d decoder weights are stored as %s: weight_quant=%s widens them to %s%s; %s",
        len(decoder),
        fmt.describe(),
        mode,
        str(dtype).replace("torch.", ""),
        f" and quantizes them again as {mode}" if mode != "none" else "",
        f"weight_quant={fmt.mode} keeps them as stored"
        if fmt.keeps(WeightQuant(fmt.mode))
        else f"the node's {fmt.mode} cannot hold this layout as stored",
    )


class _QuantizeOnLoad:
    """The decoder projections (and the LM head, ``WeightQuant.head``) quantized while the checkpoint streams in.

    Each checkpoint matrix is quantized into its projection's rows as it arrives, a piece of rows at a time
    (rows are quantized independently, so the parts of a fused projection store what the fused weight would):
    no float copy of a projection is built on the device, only the pieces' fp32 working copies. A projection
    whose matrices are all stored as integers that its quantized format holds unchanged (the stored format's
    ``keeps``: :mod:`.int_weights`, :mod:`.awq_weights`, :mod:`.gptq_weights`) is filled from them instead. A
    head tied to the embedding table is quantized from the table once the checkpoint is in (:meth:`finish`);
    the table stays.
    """

    def __init__(
        self,
        model: Qwen3VLModel,
        quant: WeightQuant,
        dtype: torch.dtype,
        device: torch.device,
        fmt: StoredFormat | None,
        stored: frozenset[str],
    ) -> None:
        self.model, self.dtype, self.device, self.fmt = model, dtype, device, fmt
        # module name -> (parent, attr, module, how it is stored)
        self.modules: dict[str, tuple[nn.Module, str, nn.Module, WeightQuant]] = {}
        self.owner: dict[str, str] = {}  # checkpoint view name -> module name
        self.remaining: dict[str, set[str]] = {}
        self.tied_head = quant.head if model.config.tie_word_embeddings else None
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
        if quant.head and not self.tied_head:
            self.modules["lm_head"] = (model, "lm_head", model.lm_head, quant.head)
            self.remaining["lm_head"] = {"lm_head.weight"}
            self.owner["lm_head.weight"] = "lm_head"
        self.deferred = frozenset(id(m.weight) for _, _, m, _ in self.modules.values())
        # module name -> how it keeps the checkpoint's stored values (all of its matrices are stored so)
        self.keeping: dict[str, WeightQuant] = {}
        for name, (_, _, _, how) in self.modules.items():
            keep = fmt.keeps(how) if fmt and self.remaining[name] <= stored else None
            if keep:
                self.keeping[name] = keep
        # The group size applies where the node picks the groups: not to projections kept in the checkpoint's.
        quant.check(
            tuple(
                module.weight.shape[1]
                for name, (_, _, module, how) in self.modules.items()
                if how is quant and self.keeping.get(name, quant).group_size == quant.group_size
            )
        )
        self.building: dict[str, QuantizedLinear] = {}  # projections being filled

    def kept_views(self) -> set[str]:
        """The checkpoint views whose stored values are kept (:meth:`store`, not :meth:`quantize`)."""
        return {view for view, name in self.owner.items() if name in self.keeping}

    def quantize(self, view: str, weight: torch.Tensor) -> None:
        """The float checkpoint matrix ``view`` (on any device) quantized into its projection's rows from the
        values the float model holds (cast to its dtype a piece at a time on the device: no whole-matrix copy
        there, which for the 8B's untied LM head in fp16 from bf16 would be 2.5 GB of a Jetson's memory)."""
        name = self.owner[view]
        module = self._building(name, self.modules[name][3])
        module.quantize_rows(self._rows(self.modules[name][2], view), weight, self.dtype)

    def store(self, view: str, tensor: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """The stored matrix ``view`` (and its scales etc., ``parts``) into its kept projection's rows."""
        name = self.owner[view]
        module = self._building(name, self.keeping[name])
        self.fmt.store_into(module, self._rows(self.modules[name][2], view), tensor, **parts)

    def _building(self, name: str, how: WeightQuant) -> QuantizedLinear:
        """Projection ``name`` as it is being filled, allocated in ``how``'s format when its first matrix comes."""
        if name not in self.building:
            n, k = self.modules[name][2].weight.shape
            self.building[name] = QuantizedLinear(n, k, how.mode, how.group_size, device=self.device)
        return self.building[name]

    def loaded(self, view: str) -> None:
        name = self.owner[view]
        self.remaining[name].discard(view)
        if not self.remaining[name]:
            parent, attr, _, _ = self.modules.pop(name)
            setattr(parent, attr, self.building.pop(name))

    def finish(self) -> None:
        """After the last tensor: a tied head quantized from the embedding table (which stays as it is)."""
        if self.tied_head:
            self.model.lm_head = QuantizedLinear.from_weight(self.model.lm_head.weight, self.tied_head)

    @staticmethod
    def _rows(module: nn.Module, view: str) -> slice:
        """The rows of ``module``'s weight that the checkpoint matrix ``view`` fills."""
        if not isinstance(module, FusedLinear):
            return slice(0, module.weight.shape[0])
        return module.part_rows()[view.rsplit(".", 2)[-2]]


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
    files: list[Path], expected: dict[str, tuple[int, ...]], tied: bool, fmt: StoredFormat | None
) -> tuple[dict[str, tuple[Path, str]], dict[str, dict[str, tuple[Path, str]]]]:
    """(checkpoint key -> (file, parameter name), parameter name -> {keyword: (file, key)} of the tensors its
    quantized weight is read with: the parameters stored quantized, each with its scales and zero points),
    after checking every header against the model and ``fmt``."""
    plan: dict[str, tuple[Path, str]] = {}
    seen: dict[str, str] = {}  # parameter name -> key that provides it
    unexpected: list[str] = []
    mismatched: list[str] = []
    stored: dict[str, tuple[str, str]] = {}  # name -> (key, dtype) of the weights stored quantized
    found: dict[str, dict[str, tuple[Path, str, str, tuple[int, ...]]]] = {}  # name -> keyword -> (file, key, ...)
    roles = {suffix: role for role, suffix in fmt.companions.items()} if fmt else {}
    for file in files:
        try:
            handle_ctx = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{file}: cannot open as safetensors ({exc})") from exc
        with handle_ctx as handle:
            for key in handle.keys():
                meta = handle.get_slice(key)
                dtype, shape = meta.get_dtype(), tuple(meta.get_shape())
                suffix = next((s for s in roles if key.endswith(s)), None)
                if suffix:
                    owner = checkpoint_key_to_name(key.removesuffix(suffix) + ".weight")
                    found.setdefault(owner, {})[roles[suffix]] = (file, key, dtype, shape)
                    continue
                if fmt and key.endswith(fmt.ignored_suffixes):
                    continue  # activations stay in the model's dtype; config.json gives the shapes
                if fmt and key.endswith(fmt.weight_suffix):
                    key_name = key.removesuffix(fmt.weight_suffix) + ".weight"
                else:
                    key_name = key
                name = checkpoint_key_to_name(key_name)
                if name not in expected:
                    if tied and name == "lm_head.weight":
                        continue  # tied: lm_head is embed_tokens; a saved copy is redundant
                    unexpected.append(f"{file.name}:{key}")
                    continue
                if name in seen:
                    raise CheckpointError(f"{file.name}: {key} duplicates {seen[name]} (both map to {name})")
                want = expected[name]
                if dtype not in FLOAT_DTYPES:
                    stored[name] = (key, dtype)
                    want = fmt.stored_shape(want) if fmt and len(want) == 2 else want
                if shape != want:
                    mismatched.append(f"{file.name}:{key} has shape {list(shape)}, config.json implies {list(want)}")
                seen[name] = key
                plan[key] = (file, name)
    problems = _stored_problems(stored, found, fmt, expected)
    packed = [key for key in unexpected if key.endswith(PACKED_SUFFIX)]
    if packed and fmt is None:
        problems.append(f"packed integer weights but config.json has no quantization_config: {_listing(packed)}")
    strays = {name: parts for name, parts in found.items() if name not in stored}
    if tied:
        strays.pop("lm_head.weight", None)  # the scales of a saved copy of the tied head, skipped with it
    unexpected += [f"{file.name}:{key}" for parts in strays.values() for file, key, *_ in parts.values()]
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
    companions = {name: {role: part[:2] for role, part in found.get(name, {}).items()} for name in stored}
    return plan, companions


def _stored_problems(
    stored: dict[str, tuple[str, str]],
    found: dict[str, dict[str, tuple[Path, str, str, tuple[int, ...]]]],
    fmt: StoredFormat | None,
    expected: dict[str, tuple[int, ...]],
) -> list[str]:
    """What keeps the weights ``stored`` quantized (name -> (key, dtype)) from being read as ``fmt`` with the
    scales etc. ``found`` beside them."""
    if not stored:
        return []
    if fmt is None:
        dtypes = {dtype for _, dtype in stored.values()}
        kind = "FP8" if all(d.startswith("F8_") for d in dtypes) else "/".join(sorted(dtypes))
        keys = [key for key, _ in stored.values()]
        return [f"{kind} weights but config.json has no quantization_config that describes them: {_listing(keys)}"]
    why = [
        fmt.problem(key, dtype, expected[name], {role: part[2:] for role, part in found.get(name, {}).items()})
        for name, (key, dtype) in stored.items()
    ]
    shown = [w for w in why if w]
    return [f"quantized weights: {_listing(shown)}"] if shown else []


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device, skip: frozenset[int]) -> None:
    """Replace meta parameters/buffers by uninitialised storage, keeping shared (tied) parameters shared;
    parameters whose id is in ``skip`` stay on meta (their modules are replaced by whoever deferred them)."""
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
