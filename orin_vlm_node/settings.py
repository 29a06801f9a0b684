"""Every setting of the product, written once: name, type, default, bounds, unit, when a change takes effect
and what it rebuilds.

The frontends are derived from this table, never typed again: the node's ROS parameters and descriptors
(``ros/params.py``), the command-line flags (``generate.py``: ``page_size`` is ``--page-size``), the launch
file's arguments, ``EngineConfig``'s defaults and rebuild rules, and (held to it by tests) ``config/orin_vlm.yaml``
and the README's parameter table. A value is checked here against its type and bounds only; every rule beyond
that lives in the layer that owns it (docs/architecture.md, "Settings"). A setting's consumer is the engine
(``EngineConfig``, applied between requests), sampling (``SamplingParams``, the next prompt) or the node.
Standard library only: the launch file imports it in the ``ros2 launch`` process, which must not pay for torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Value = bool | int | float | str | list[str]
Applies = Literal["read_only", "between_requests", "next_prompt"]
Consumer = Literal["engine", "sampling", "node", "remote"]
# What a change rebuilds in the engine ("": nothing, it is read by the next request or switched in place).
Rebuilds = Literal["", "model", "kv_cache", "backend", "images", "vision_cache"]

APPLIES_TEXT = {"read_only": "read-only", "between_requests": "between requests", "next_prompt": "next prompt"}
REBUILDS_TEXT = {
    "": "nothing",
    "model": "the model, KV cache and decode step (sessions dropped)",
    "kv_cache": "the KV cache and decode step (sessions dropped)",
    "backend": "the kernel choice and decode step",
    "images": "the image processor and vision cache",
    "vision_cache": "the vision cache",
}


@dataclass(frozen=True)
class Setting:
    """One setting. ``min``/``max`` are inclusive bounds (of a list: its length); ``choices`` the accepted
    strings. A list setting is a list of distinct, non-empty strings (a ROS string array)."""

    name: str
    type: type
    default: Value
    description: str
    consumer: Consumer
    applies: Applies
    unit: str = ""
    min: int | float | None = None
    max: int | float | None = None
    choices: tuple[str, ...] = ()
    per_channel: bool = False  # a channel may override it (``<channel>.<name>``); unset = this value
    rebuilds: Rebuilds = ""  # what a change rebuilds (engine settings)

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not acceptable (type, choices, bounds), or None."""
        if self.type is bool:
            ok = isinstance(value, bool)
        elif self.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.type is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        elif self.type is list:
            ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value)
        else:
            ok = isinstance(value, str)
        if not ok:
            return f"{self.name} must be {_TYPE_TEXT[self.type]}, got {value!r}"
        if self.type is list:
            return self._list_problem(value)
        if self.choices and value not in self.choices:
            return f"{self.name} must be one of {', '.join(self.choices)}, got {value!r}"
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            unit = f" {self.unit}" if self.unit else ""
            return f"{self.name} must be in {self.min:g}..{self.max:g}{unit}, got {value!r}"
        return None

    def _list_problem(self, value: Sequence[str]) -> str | None:
        repeated = sorted({v for v in value if value.count(v) > 1})
        if repeated:
            return f"{self.name} lists {', '.join(repeated)} more than once"
        if not self.min <= len(value) <= self.max:
            return f"{self.name} must have {self.min}..{self.max} entries, got {len(value)}"
        return None

    @property
    def flag(self) -> str:
        """The command-line spelling: ``--page-size``."""
        return "--" + self.name.replace("_", "-")


_TYPE_TEXT = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list of non-empty strings",
}


def _s(name, type_, default, description, consumer, applies, **bounds) -> Setting:
    return Setting(name, type_, default, description, consumer, applies, **bounds)


E, S, N, R = "engine", "sampling", "node", "remote"
RO, BETWEEN, NEXT = "read_only", "between_requests", "next_prompt"
MODEL, KV, BACKEND, IMAGES, VISION = "model", "kv_cache", "backend", "images", "vision_cache"
MEGA = 1_000_000

SETTINGS: tuple[Setting, ...] = (
    # -- model and device
    _s("model_path", str, "", "Qwen3-VL directory (Hugging Face format); '' = the embedded default model", E, RO,
       rebuilds=MODEL),
    _s("device", str, "auto", "where the model runs; auto = cuda when available", E, BETWEEN,
       choices=("auto", "cuda", "cpu"), rebuilds=MODEL),
    _s("dtype", str, "auto", "weights and activations; auto = the checkpoint's on CUDA, fp32 on CPU", E, BETWEEN,
       choices=("auto", "bf16", "fp16", "fp32"), rebuilds=MODEL),
    _s("weight_quant", str, "none", "store the text decoder's projection weights quantized at load: int8 (per "
       "output channel) or int4 (per group of weight_quant_group_size inputs); activations stay in dtype. A "
       "checkpoint stored in integers of that width (compressed-tensors, AWQ, GPTQ) is kept as stored", E, RO,
       choices=("none", "int8", "int4"), rebuilds=MODEL),
    _s("weight_quant_group_size", int, 128, "int4: weights per scale and offset along the input; a power of two "
       "no larger than any projection's input (a 4-bit checkpoint's own groups are kept)", E, RO, min=2, max=8192,
       rebuilds=MODEL),
    _s("weight_quant_lm_head", bool, True, "with weight_quant int8 or int4, store the LM head in int8 too (per "
       "output channel, whatever the mode: every logit goes through it); a head tied to the embedding table is "
       "a copy beside it, half its bytes", E, RO, rebuilds=MODEL),
    # -- KV cache
    _s("use_paged_attention", bool, True, "paged KV cache (block pool); false = contiguous baseline", E, BETWEEN,
       rebuilds=KV),
    _s("page_size", int, 16, "tokens per KV block; a power of two", E, BETWEEN, unit="tokens", min=1, max=256,
       rebuilds=KV),
    _s("kv_pool_mb", int, 0, "KV pool size; 0 = sized by need (contexts held + prefix share, capped by free "
       "memory)", E, BETWEEN, unit="MB", min=0, max=262_144, rebuilds=KV),
    _s("kv_pool_blocks", int, 0, "KV pool size in blocks; > 0 wins over kv_pool_mb", E, BETWEEN, min=0,
       max=16_777_216, rebuilds=KV),
    _s("kv_prefix_share", float, 0.25, "automatic pool size: extra share of blocks for cached prefixes", E,
       BETWEEN, min=0.0, max=4.0, rebuilds=KV),
    _s("kv_memory_reserve_mb", int, 1024, "automatic pool size: memory left free for the rest of the robot", E,
       BETWEEN, unit="MB", min=0, max=1_048_576, rebuilds=KV),
    _s("prefix_caching", bool, True, "reuse the KV blocks of an identical prompt prefix (paged only)", E, BETWEEN),
    _s("max_context_tokens", int, 4096, "longest sequence: prompt, image tokens and answer", E, BETWEEN,
       unit="tokens", min=16, max=262_144, rebuilds=KV),
    _s("max_batch", int, 4, "requests decoded together, one token each per step (continuous batching); the "
       "automatic KV pool holds this many contexts (a node: at most one per channel)", E, BETWEEN, unit="requests",
       min=1, max=16, rebuilds=KV),
    _s("prefill_chunk_tokens", int, 512, "a prompt is prefilled in pieces of at most this many tokens (bounds "
       "the attention scratch memory of a long prompt); 0 = in one piece", E, BETWEEN, unit="tokens", min=0,
       max=262_144),
    # -- CUDA
    _s("use_cuda_kernels", bool, True, "custom CUDA attention kernels (CUDA only)", E, BETWEEN, rebuilds=BACKEND),
    _s("use_cuda_graph", bool, True, "replay the decode step as CUDA graphs (CUDA only); float projections take "
       "the GEMV kernels only then (they are timed as a graph runs them)", E, BETWEEN, rebuilds=BACKEND),
    _s("allow_kernel_fallback", bool, True, "true: torch attention, reported as 'kernels: off (<reason>)', when "
       "the kernels cannot be used; false: that is a startup error", E, BETWEEN, rebuilds=BACKEND),
    _s("kernel_dir", str, "", "CUDA kernel sources; '' = the ones installed with the package", E, BETWEEN,
       rebuilds=BACKEND),
    _s("kernel_cache_dir", str, "", "compiled kernel cache; '' = ~/.cache/orin_vlm_node/kernels", E, BETWEEN,
       rebuilds=BACKEND),
    # -- images
    _s("image_min_pixels", int, 0, "smallest image area after resizing; 0 = the checkpoint's value", E, BETWEEN,
       unit="pixels", min=0, max=64 * MEGA, rebuilds=IMAGES),
    _s("image_max_pixels", int, 0, "largest image area after resizing; 0 = the checkpoint's value", E, BETWEEN,
       unit="pixels", min=0, max=64 * MEGA, rebuilds=IMAGES),
    _s("video_max_tokens", int, 2048, "most visual tokens one video may take: its frames are made smaller, then "
       "dropped evenly, to fit (a long history cannot overflow max_context_tokens)", E, BETWEEN, unit="tokens",
       min=16, max=MEGA, rebuilds=IMAGES),
    _s("vision_cache_images", int, 4, "vision-tower outputs kept for the last distinct images (by content), so "
       "another question about the same frame skips the vision tower; 0 = off", E, BETWEEN, unit="images", min=0,
       max=256, rebuilds=VISION),
    # -- prompts
    _s("prompt_special_tokens", bool, False, "read special-token text written in prompts and the system "
       "prompt (im_start, im_end, endoftext, ...) as control tokens (experts only); false = as plain text, so a "
       "prompt cannot forge the chat structure", E, BETWEEN),
    # -- a remote server (backend openai)
    _s("backend", str, "local", "where answers are computed: local = the model on this machine; openai = the "
       "OpenAI-compatible server at remote_url (vLLM, SGLang, llama.cpp's server, Ollama), no model loaded here",
       R, RO, choices=("local", "openai")),
    _s("remote_url", str, "", "backend openai: the server's API root, e.g. http://gpu-box:8000/v1", R, RO),
    _s("remote_model", str, "", "backend openai: the model as the server's GET /v1/models lists it", R, RO),
    _s("remote_api_key_env", str, "", "backend openai: the environment variable that holds the API key ('' = "
       "no key); the key itself is never a parameter and never logged", R, RO),
    _s("remote_timeout_s", float, 30.0, "backend openai: connection timeout, and the longest wait for the next "
       "part of an answer", R, RO, unit="s", min=0.1, max=3600.0),
    _s("remote_ca_bundle", str, "", "backend openai: CA bundle (PEM) that https certificates are checked "
       "against; '' = the system's", R, RO),
    _s("remote_image_format", str, "jpeg", "backend openai: how camera frames travel (jpeg: quality 90, ~6x "
       "smaller; png: lossless, the pixels the model would see locally)", R, RO, choices=("jpeg", "png")),
    # -- sampling
    _s("max_new_tokens", int, 128, "longest answer", S, NEXT, unit="tokens", min=1, max=32_768, per_channel=True),
    _s("temperature", float, 0.0, "sampling temperature; 0 = greedy (deterministic)", S, NEXT, min=0.0, max=5.0),
    _s("top_p", float, 1.0, "nucleus sampling mass, above 0; 1 = off", S, NEXT, min=0.0, max=1.0),
    _s("top_k", int, 0, "keep the k most likely tokens; 0 = off", S, NEXT, min=0, max=1_000_000),
    _s("min_p", float, 0.0, "drop tokens below min_p x the top probability; 0 = off", S, NEXT, min=0.0, max=1.0),
    _s("repetition_penalty", float, 1.0, "penalty on tokens already present; 1 = off", S, NEXT, min=0.01,
       max=10.0),
    _s("presence_penalty", float, 0.0, "subtracted from the logits of tokens already generated; 0 = off", S, NEXT,
       min=-2.0, max=2.0),
    _s("seed", int, -1, "sampling seed; -1 = a fresh random seed per prompt", S, NEXT, min=-1, max=2**31 - 1),
    # -- node
    _s("system_prompt", str, "", "system message of every conversation; '' = none", N, NEXT, per_channel=True),
    _s("output_format", str, "", "what every answer must match, as JSON: {\"choice\": [\"yes\", \"no\"]}, "
       "{\"regex\": \"...\"} or {\"json_schema\": {...}}; '' = free text (a prompt on prompt_json may carry its "
       "own)", N, NEXT, per_channel=True),
    _s("detect_max_labels", int, 20, "most labels one detection request may name (its prompt and format grow "
       "with each)", N, NEXT, unit="labels", min=1, max=200),
    _s("detections_image", bool, False, "publish each frame of a detection request with its boxes drawn on "
       "detections_image (sensor_msgs/Image, for rviz or rqt_image_view)", N, RO),
    _s("multi_turn", bool, False, "keep the conversation (one engine session) until ~/reset; one that would "
       "pass max_context_tokens starts over with the prompt", N, NEXT),
    _s("image_max_input_pixels", int, 4096 * 3072, "largest camera frame accepted, checked from the header "
       "before decoding (a compressed frame declaring more is refused undecoded); the default takes 4K and 12 MP "
       "cameras", N, NEXT, unit="pixels", min=1, max=64 * MEGA),
    _s("image_reliability", str, "auto", "QoS reliability of the image subscriptions; auto = reliable when every "
       "publisher on the topic is reliable (large raw frames arrive whole), else best effort", N, RO,
       choices=("auto", "reliable", "best_effort")),
    _s("image_topics", list, ["image"], "cameras a prompt looks at: the latest frame of each (raw, and compressed "
       "on <topic>/compressed), in this order, as the prompt's images", N, RO, unit="topics", min=1, max=8,
       per_channel=True),
    _s("image_max_age_s", float, 2.0, "a prompt uses the latest image of each topic not older than this; 0 = no "
       "images", N, NEXT, unit="s", min=0.0, max=3600.0),
    _s("video_seconds", float, 0.0, "a prompt sends the last this many seconds of each camera as a video (its "
       "frames and their stamps) instead of the latest frame; 0 = the latest frame (a prompt on prompt_json may "
       "ask its own)", N, NEXT, unit="s", min=0.0, max=600.0, per_channel=True),
    _s("video_fps", float, 2.0, "frames a second a video prompt sends (at most video_history_fps are kept)", N,
       NEXT, unit="frames/s", min=0.05, max=30.0, per_channel=True),
    _s("video_history_s", float, 10.0, "seconds of frames kept per camera for video prompts; 0 = none kept",
       N, NEXT, unit="s", min=0.0, max=600.0),
    _s("video_history_fps", float, 2.0, "frames a second kept per camera, by their header stamps", N, NEXT,
       unit="frames/s", min=0.05, max=30.0),
    _s("video_frame_pixels", int, 640 * 400, "a kept frame is scaled down to at most this area", N, NEXT,
       unit="pixels", min=32 * 32, max=64 * MEGA),
    _s("video_history_mb", int, 64, "memory of the kept frames of all cameras together; the oldest go first",
       N, NEXT, unit="MB", min=1, max=65536),
    _s("prompt_queue_depth", int, 1000, "messages the prompt subscription holds for the node (a burst beyond "
       "it is lost by DDS before the node sees it)", N, RO, min=1, max=100_000),
    _s("max_queue", int, 4, "prompts waiting behind the running one; overflow drops the oldest", N, NEXT, min=1,
       max=1000),
    _s("token_publish_period_ms", int, 20, "at most one tokens message per period, the first delta of an answer "
       "at once; 0 = one message per delta", N, NEXT, unit="ms", min=0, max=1000),
    _s("channels", list, [], "askers served side by side, each on <channel>/prompt, tokens, response, status and "
       "~/<channel>/reset, cancel with its own conversation and queue; names are letters, digits and _; empty = "
       "one asker on prompt, tokens, response, status", N, RO, unit="channels", min=0, max=16),
)  # fmt: skip

CHANNEL_SETTINGS: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.per_channel)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def settings_for(consumer: Consumer) -> tuple[Setting, ...]:
    return tuple(s for s in SETTINGS if s.consumer == consumer)


def defaults() -> dict[str, Value]:
    """Every setting's default (lists copied: a caller may change its dict's values)."""
    return {s.name: list(s.default) if isinstance(s.default, list) else s.default for s in SETTINGS}


def problem(values: Mapping[str, Any]) -> str | None:
    """The first unknown name or out-of-bounds value among ``values``, or None."""
    for name, value in values.items():
        setting = BY_NAME.get(name)
        if setting is None:
            return f"unknown setting {name!r}"
        reason = setting.problem(value)
        if reason:
            return reason
    return None


def check(values: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first unknown or out-of-bounds value."""
    reason = problem(values)
    if reason:
        raise ValueError(reason)
