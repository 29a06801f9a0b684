"""Turning logits into the next token: parameter resolution, validation and the sampler.

Settings come in three layers, later ones winning field by field: the checkpoint's
``generation_config.json`` (what the model authors tuned), ``EngineConfig.sampling`` (what the operator
configured for this robot) and the request's own ``SamplingParams``. :func:`resolve_sampling` folds them
into one :class:`ResolvedSampling` with every field set, so the decode loop never asks "is this None?".

The logits pipeline follows the order transformers uses (repetition penalty, then temperature, top-k,
top-p, min-p) so a request behaves the same here as under ``model.generate``; presence penalty (which
transformers lacks, Qwen recommends it for VL-Instruct) is applied with the repetition penalty, on the
tokens generated so far, as OpenAI/vLLM define it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from .. import settings
from ..processing.files import read_json_object
from .events import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class ResolvedSampling:
    """Sampling settings with every field decided (no ``None``)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    seed: int
    max_new_tokens: int
    stop: tuple[str, ...]
    ignore_eos: bool

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def load_generation_defaults(model_dir: str | Path) -> SamplingParams:
    """The sampling defaults of ``generation_config.json`` (all ``None`` when the file is absent).

    ``do_sample: false`` in the file means greedy, so it maps to temperature 0. Unknown or missing
    fields stay ``None`` and fall through to the built-in defaults. (Its stop ids are the tokenizer's.)
    """
    cfg = read_json_object(Path(model_dir) / "generation_config.json") or {}
    temperature = cfg.get("temperature")
    if cfg.get("do_sample") is False:
        temperature = 0.0

    def num(key: str, kind: type):
        return None if cfg.get(key) is None else kind(cfg[key])

    return SamplingParams(
        temperature=None if temperature is None else float(temperature),
        top_k=num("top_k", int),
        top_p=num("top_p", float),
        min_p=num("min_p", float),
        repetition_penalty=num("repetition_penalty", float),
        max_new_tokens=num("max_new_tokens", int),
    )


def merge_sampling(*layers: SamplingParams) -> SamplingParams:
    """Field-wise overlay: a later layer's non-``None`` field (non-empty ``stop``) wins."""
    merged: dict[str, object] = {}
    for layer in layers:
        for f in fields(SamplingParams):
            value = getattr(layer, f.name)
            if f.name == "stop":
                if value:
                    merged["stop"] = tuple(value)
            elif value is not None:
                merged[f.name] = value
    return SamplingParams(**merged)  # type: ignore[arg-type]


def validate_sampling(p: SamplingParams) -> None:
    """Raise ``ValueError`` naming the first bad field (``None`` fields are not checked).

    Bounds come from the settings schema; the rules beyond them are the sampler's: ``top_p`` above 0, a
    concrete ``seed`` non-negative (-1, "random", is the node's spelling of ``None``).
    """
    for f in fields(SamplingParams):
        value = getattr(p, f.name)
        if value is None or f.name not in settings.BY_NAME:
            continue
        reason = settings.BY_NAME[f.name].problem(value)
        if reason:
            raise ValueError(reason)
    if p.top_p is not None and p.top_p <= 0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p.top_p}")
    if p.seed is not None and p.seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {p.seed!r}")
    if p.ignore_eos is not None and not isinstance(p.ignore_eos, bool):
        raise ValueError(f"ignore_eos must be true or false, got {p.ignore_eos!r}")
    if not isinstance(p.stop, tuple) or any(not isinstance(s, str) or not s for s in p.stop):
        raise ValueError(f"stop must be a tuple of non-empty strings, got {p.stop!r}")


def resolve_sampling(*layers: SamplingParams) -> ResolvedSampling:
    """Validate every layer, overlay them and fill what is still unset with neutral values."""
    for layer in layers:
        validate_sampling(layer)
    m = merge_sampling(*layers)
    return ResolvedSampling(
        temperature=1.0 if m.temperature is None else float(m.temperature),
        top_k=0 if m.top_k is None else int(m.top_k),
        top_p=1.0 if m.top_p is None else float(m.top_p),
        min_p=0.0 if m.min_p is None else float(m.min_p),
        repetition_penalty=1.0 if m.repetition_penalty is None else float(m.repetition_penalty),
        presence_penalty=0.0 if m.presence_penalty is None else float(m.presence_penalty),
        # An unseeded request still gets a concrete seed so it can be reported and replayed.
        seed=secrets.randbits(63) if m.seed is None else int(m.seed),
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS if m.max_new_tokens is None else int(m.max_new_tokens),
        stop=tuple(m.stop),
        ignore_eos=bool(m.ignore_eos),
    )


def apply_penalties(
    logits: torch.Tensor, context_ids: torch.Tensor, generated_ids: torch.Tensor, params: ResolvedSampling
) -> torch.Tensor:
    """Repetition penalty over prompt + generated ids (transformers semantics: divide positive logits,
    multiply negative ones), presence penalty over generated ids (subtract once per distinct token).

    ``logits``: (..., V) float; id tensors: 1-D long on the logits' device. Returns a new tensor.
    """
    out = logits
    if params.repetition_penalty != 1.0 and context_ids.numel() > 0:
        out = out.clone()
        picked = out.gather(-1, context_ids.expand(*out.shape[:-1], -1))
        picked = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
        out.scatter_(-1, context_ids.expand(*out.shape[:-1], -1), picked)
    if params.presence_penalty != 0.0 and generated_ids.numel() > 0:
        out = out.clone() if out is logits else out
        seen = torch.zeros(out.shape[-1], dtype=torch.bool, device=out.device)
        seen.index_fill_(0, generated_ids, True)  # a scalar fill: no host value copied to the device
        out = out - seen.to(out.dtype) * params.presence_penalty
    return out


def filter_logits(logits: torch.Tensor, params: ResolvedSampling) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masking (removed entries become -inf).

    ``logits``: (..., V). Works on fp32 copies so low-precision models sample from the same
    distribution as fp32 ones. At least one token always survives (the most likely one).
    """
    x = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest set whose mass reaches top_p: drop a token when the mass before it already does.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * params.min_p
        x = x.masked_fill(probs < threshold, float("-inf"))
    return x


class Sampler:
    """Picks next tokens for one request; owns that request's ``torch.Generator`` so a seed replays
    exactly, whatever other requests or threads do with the global RNG."""

    def __init__(self, params: ResolvedSampling, device: torch.device | str = "cpu"):
        self.params = params
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(params.seed)

    def probabilities(
        self, logits: torch.Tensor, context_ids: torch.Tensor | None = None, generated_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The distribution sampling draws from, (..., V) fp32 (for tests and diagnostics)."""
        empty = torch.empty(0, dtype=torch.long, device=logits.device)
        x = apply_penalties(
            logits,
            empty if context_ids is None else context_ids,
            empty if generated_ids is None else generated_ids,
            self.params,
        )
        if self.params.greedy:
            return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float()
        return torch.softmax(filter_logits(x, self.params), dim=-1)

    def sample(
        self, logits: torch.Tensor, context_ids: torch.Tensor | None = None, generated_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Next token id(s): ``logits`` (V,) -> () long, or (N, V) -> (N,) long (independent draws)."""
        squeeze = logits.dim() == 1
        x = logits.unsqueeze(0) if squeeze else logits
        if self.params.greedy:
            empty = torch.empty(0, dtype=torch.long, device=x.device)
            x = apply_penalties(
                x,
                empty if context_ids is None else context_ids,
                empty if generated_ids is None else generated_ids,
                self.params,
            )
            out = x.argmax(-1)
        else:
            probs = self.probabilities(x, context_ids, generated_ids)
            out = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        return out[0] if squeeze else out
