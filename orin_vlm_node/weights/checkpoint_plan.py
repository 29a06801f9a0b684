"""Every safetensors header checked against the model before any data is read: which checkpoint key fills
which parameter, and which tensors (scales, zero points) a weight stored quantized is read with. Missing or
unexpected keys, shape mismatches and quantized weights without fitting companions raise one
:class:`CheckpointError` that names the files and keys."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from ..model.errors import CheckpointError
from .integer import PACKED_SUFFIX
from .keys import checkpoint_key_to_name, name_to_checkpoint_key
from .stored_format import StoredFormat

MAX_LISTED = 8  # keys named in one error message
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names; a weight in another dtype is stored quantized


def plan_checkpoint(
    files: list[Path], expected: dict[str, tuple[int, ...]], tied: bool, fmt: StoredFormat | None
) -> tuple[dict[str, tuple[Path, str]], dict[str, dict[str, tuple[Path, str]]]]:
    """(checkpoint key -> (file, parameter name), parameter name -> {keyword: (file, key)} of the tensors its
    quantized weight is read with: the parameters stored quantized, each with its scales and zero points),
    after checking every header against the model and ``fmt``."""
    headers = _Headers(expected, tied, fmt)
    for file in files:
        try:
            handle_ctx = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{file}: cannot open as safetensors ({exc})") from exc
        with handle_ctx as handle:
            for key in handle.keys():
                meta = handle.get_slice(key)
                headers.add(file, key, meta.get_dtype(), tuple(meta.get_shape()))
    problems = headers.problems()
    if problems:
        where = files[0].parent
        raise CheckpointError(f"{where}: checkpoint does not match config.json; " + "; ".join(problems))
    found = headers.found
    companions = {name: {role: part[:2] for role, part in found.get(name, {}).items()} for name in headers.stored}
    return headers.plan, companions


class _Headers:
    """What the headers read so far provide, against what the model ``expected`` (parameter name -> shape)."""

    def __init__(self, expected: dict[str, tuple[int, ...]], tied: bool, fmt: StoredFormat | None) -> None:
        self.expected, self.tied, self.fmt = expected, tied, fmt
        self.plan: dict[str, tuple[Path, str]] = {}
        self.seen: dict[str, str] = {}  # parameter name -> key that provides it
        self.unexpected: list[str] = []
        self.mismatched: list[str] = []
        self.stored: dict[str, tuple[str, str]] = {}  # name -> (key, dtype) of the weights stored quantized
        self.found: dict[str, dict[str, tuple[Path, str, str, tuple[int, ...]]]] = {}  # name -> role -> (file, key..)
        self.roles = {suffix: role for role, suffix in fmt.companions.items()} if fmt else {}

    def add(self, file: Path, key: str, dtype: str, shape: tuple[int, ...]) -> None:
        fmt = self.fmt
        suffix = next((s for s in self.roles if key.endswith(s)), None)
        if suffix:
            owner = checkpoint_key_to_name(key.removesuffix(suffix) + ".weight")
            self.found.setdefault(owner, {})[self.roles[suffix]] = (file, key, dtype, shape)
            return
        if fmt and key.endswith(fmt.ignored_suffixes):
            return  # activations stay in the model's dtype; config.json gives the shapes
        stored_weight = fmt and key.endswith(fmt.weight_suffix)
        name = checkpoint_key_to_name(key.removesuffix(fmt.weight_suffix) + ".weight" if stored_weight else key)
        if name not in self.expected:
            if not (self.tied and name == "lm_head.weight"):  # tied: lm_head is embed_tokens; a copy is redundant
                self.unexpected.append(f"{file.name}:{key}")
            return
        if name in self.seen:
            raise CheckpointError(f"{file.name}: {key} duplicates {self.seen[name]} (both map to {name})")
        want = self.expected[name]
        if dtype not in FLOAT_DTYPES:
            self.stored[name] = (key, dtype)
            want = fmt.stored_shape(want) if fmt and len(want) == 2 else want
        if shape != want:
            self.mismatched.append(f"{file.name}:{key} has shape {list(shape)}, config.json implies {list(want)}")
        self.seen[name] = key
        self.plan[key] = (file, name)

    def problems(self) -> list[str]:
        problems = _stored_problems(self.stored, self.found, self.fmt, self.expected)
        unexpected = list(self.unexpected)
        packed = [key for key in unexpected if key.endswith(PACKED_SUFFIX)]
        if packed and self.fmt is None:
            problems.append(f"packed integer weights but config.json has no quantization_config: {_listing(packed)}")
        strays = {name: parts for name, parts in self.found.items() if name not in self.stored}
        if self.tied:
            strays.pop("lm_head.weight", None)  # the scales of a saved copy of the tied head, skipped with it
        unexpected += [f"{file.name}:{key}" for parts in strays.values() for file, key, *_ in parts.values()]
        if self.mismatched:
            problems.append(f"shape mismatch: {_listing(self.mismatched)}")
        if unexpected:
            problems.append(f"unexpected keys: {_listing(unexpected)}")
        missing = [name_to_checkpoint_key(name) for name in self.expected if name not in self.seen]
        if missing:
            problems.append(f"missing keys: {_listing(missing)}")
        return problems


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
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f" (+{len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else "")
