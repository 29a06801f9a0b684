"""Load an HF-format Qwen3-VL directory into :class:`Qwen3VLModel`, streaming tensor by tensor.

Why streamed: on a Jetson the CPU and GPU share one memory, so building the model with initialised
weights and then loading a state dict would need twice the model size. Here the module tree is built
on the meta device (no storage), each parameter is allocated once, empty, in the target dtype on the
target device, and every checkpoint tensor is read from its safetensors file and copied into place
(cast on the way). Peak memory is about the model size plus the largest single tensor.

More in docs/modules.md, ``orin_vlm_node/weights/loader.py``.
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

from ..model.config import ModelConfig
from ..model.dtypes import resolve_dtype
from ..model.errors import CheckpointError
from ..model.qwen3_vl import Qwen3VLModel
from .checkpoint_plan import MAX_LISTED, plan_checkpoint
from .keys import checkpoint_views
from .projections import ProjectionBuilder, ProjectionKernels
from .quant import WeightQuant, weight_bytes
from .quantize_on_load import QuantizeOnLoad
from .sites import HEAD, Site, SiteFill, projection_sites
from .stored_format import INTEGER_FORMATS, StoredFormat, checkpoint_format

logger = logging.getLogger("orin_vlm_node.model")

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# A progress line at most this often: an 8B checkpoint from a Jetson's eMMC takes a minute, a small one
# loads before the first line would be worth reading.
PROGRESS_INTERVAL_S = 2.0


def load_model(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device="cpu",
    quant: WeightQuant | None = None,
    projections: ProjectionBuilder | None = None,
) -> Qwen3VLModel:
    """Build the model for ``path`` (config.json + safetensors) in ``dtype`` on ``device``; with ``quant``
    the text decoder's projections are stored quantized, each as soon as its checkpoint matrices are in
    (so the float copy of the whole decoder never exists). ``projections`` builds each projection with the
    kernels that multiply it once its weights are in (default: torch's); its ``path`` then says how."""
    t0 = time.perf_counter()
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: model directory does not exist")
    target, device = resolve_dtype(dtype), torch.device(device)
    config = ModelConfig.from_dir(root)
    fmt = checkpoint_format(root, config.raw)
    files = weight_files(root)
    with torch.device("meta"):
        model = Qwen3VLModel(config)
    expected = {name: tuple(view.shape) for name, view in checkpoint_views(model).items()}
    plan, companions = plan_checkpoint(files, expected, config.tie_word_embeddings, fmt)
    sites = projection_sites(model)
    quantizer = (
        QuantizeOnLoad(sites, quant, config.tie_word_embeddings, target, device, fmt, frozenset(companions))
        if quant and quant.mode != "none"
        else None
    )
    _materialize(model, target, device, skip=quantizer.deferred if quantizer else frozenset())
    builder = projections or ProjectionBuilder(ProjectionKernels(), target)
    build = _Build(sites, SiteFill(sites, {name for _, name in plan.values()}), quantizer, builder)
    load = _Load(root, files, plan, companions, checkpoint_views(model), target, device, fmt, quantizer, build)
    load.announce(quant)
    load.stream()
    build.finish(model)
    if device.type == "cuda":
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


class _Build:
    """Each projection built (``builder``) in its site's place as soon as its last checkpoint matrix is in:
    the quantized module ``quantizer`` filled, or the float weight as loaded."""

    def __init__(self, sites: dict[str, Site], fill: SiteFill, quantizer, builder: ProjectionBuilder) -> None:
        self.sites, self.fill, self.quantizer, self.builder = sites, fill, quantizer, builder

    def loaded(self, view: str) -> None:
        name = self.fill.loaded(view)
        if name is not None:
            self._build(name, self.quantizer.built(name) if self.quantizer else None)

    def finish(self, model: Qwen3VLModel) -> None:
        """After the last tensor: the sites no matrix completed (a tied head, quantized from the embedding
        table where asked), then the builder settled."""
        head = self.quantizer.tied_head_module(model) if self.quantizer else None
        for name in self.fill.rest():
            self._build(name, head if name == HEAD else None)
        self.builder.settle()

    def _build(self, name: str, module: nn.Module | None) -> None:
        site = self.sites[name]
        setattr(site.parent, site.attr, self.builder.build(module or site.module, site.swiglu, site.is_head))


class _Load:
    """One checkpoint read into a materialised model: every planned tensor, file by file, copied, widened or
    quantized into its view, with a progress line every ``PROGRESS_INTERVAL_S``."""

    def __init__(self, root, files, plan, companions, views, dtype, device, fmt, quantizer, build) -> None:
        self.root, self.files, self.plan, self.companions = root, files, plan, companions
        self.views, self.dtype, self.device, self.fmt, self.quantizer = views, dtype, device, fmt, quantizer
        self.build = build
        self.element = torch.empty((), dtype=dtype).element_size()
        self.total = sum(views[name].numel() for _, name in plan.values()) * self.element
        self.kept = quantizer.kept_views() if quantizer else set()

    def announce(self, quant: WeightQuant | None) -> None:
        """The log line of what is about to load, and the warning when integer weights are widened."""
        fmt, quantizer = self.fmt, self.quantizer
        stored = (
            f", {len(self.companions)} of them stored as {fmt.describe()}, {len(self.kept)} kept as stored"
            if fmt
            else ""
        )
        head = f", LM head as {quant.head.mode}" if quant and quant.head else ""
        logger.info(
            "loading %s: %d tensors from %d file(s), %.1f MB as %s on %s%s%s",
            self.root,
            len(self.plan),
            len(self.files),
            self.total / 1e6,
            str(self.dtype).replace("torch.", ""),
            self.device,
            stored,
            f", decoder projections as {quant.mode}{head}" if quantizer else "",
        )
        _warn_widened_integers(fmt, set(self.companions) - self.kept, quant, self.dtype)

    def stream(self) -> None:
        widener = self.fmt.widener(self.device) if self.fmt else None
        done, last_report = 0, time.perf_counter()
        with ExitStack() as stack:
            handles = {f: stack.enter_context(safe_open(str(f), framework="pt", device="cpu")) for f in self.files}
            for file in self.files:
                for key, name in [(key, name) for key, (f, name) in self.plan.items() if f == file]:
                    self._one(handles, widener, file, key, name)
                    done += self.views[name].numel() * self.element
                    if time.perf_counter() - last_report >= PROGRESS_INTERVAL_S:
                        logger.info("  %3.0f%% (%s)", 100 * done / self.total, file.name)
                        last_report = time.perf_counter()

    def _one(self, handles, widener, file: Path, key: str, name: str) -> None:
        """Checkpoint tensor ``key`` into parameter view ``name``."""
        quantizer, view = self.quantizer, self.views[name]
        tensor = _get(handles, file, key)
        parts = {role: _get(handles, *where) for role, where in self.companions.get(name, {}).items()}
        if name in self.kept:
            quantizer.store(name, tensor, parts)
        elif quantizer and quantizer.takes(name):
            quantizer.quantize(name, _widened(widener, tensor, parts, view.shape, self.dtype, self.device))
        elif parts:
            widener.widen_into(view, tensor, **parts)
        else:
            view.copy_(tensor)
        del tensor, parts
        self.build.loaded(name)


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
            f"{root}: only PyTorch pickle weights found ({', '.join(pickles[:MAX_LISTED])}); they are refused "
            "because loading them can run arbitrary code. Convert them to safetensors (e.g. load with "
            "transformers and save_pretrained(..., safe_serialization=True))."
        )
    raise CheckpointError(f"{root}: no weights (expected model.safetensors or model.safetensors.index.json)")


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
