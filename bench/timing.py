"""Timing one generation, the same way for our engine and for transformers.

Both sides are timed from the moment the raw request (text + HWC uint8 images) is handed over, so
TTFT includes tokenisation, image preprocessing, the vision tower and prefill on both sides. The first
token is "there" when it has been sampled: for transformers that is the streamer's first ``put`` after
the prompt; for the engine it is its own ``ttft_s`` metric, checked against the arrival of the first
streamed event (see :func:`run_engine`). Decode throughput counts the tokens after the first one over
the time from the first to the last token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class GenTiming:
    ttft_s: float
    decode_tok_s: float
    token_ids: tuple[int, ...]
    prompt_tokens: int
    total_s: float
    text: str = ""
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def decode_s_per_token(self) -> float:
        return 1.0 / self.decode_tok_s if self.decode_tok_s > 0 else float("inf")


def run_engine(engine: Any, request: Any) -> GenTiming:
    """Drive ``engine.generate(request)`` to its ``Finished`` event and time it.

    The engine's ``ttft_s`` starts when the engine accepted the request; the wall time from our call to
    the first streamed event is also kept (``extra['first_event_s']``) since it can only be later
    (a delta can be held back while it might be the start of a stop string or a split UTF-8 character).
    """
    from orin_vlm_node.engine.events import Finished, TextDelta

    t0 = time.perf_counter()
    first_event = None
    finished = None
    for event in engine.generate(request):
        if isinstance(event, TextDelta) and first_event is None:
            first_event = time.perf_counter() - t0
        elif isinstance(event, Finished):
            finished = event
    total = time.perf_counter() - t0
    if finished is None:
        raise RuntimeError("engine stream ended without a Finished event")
    if finished.finish_reason == "error":
        raise RuntimeError(f"engine request failed: {finished.error}")
    m = finished.metrics
    extra = {k: float(v) for k, v in m.items() if isinstance(v, (int, float))}
    if first_event is not None:
        extra["first_event_s"] = first_event
    return GenTiming(
        ttft_s=float(m["ttft_s"]),
        decode_tok_s=float(m["decode_tokens_per_s"]),
        token_ids=tuple(finished.token_ids),
        prompt_tokens=int(m.get("prompt_tokens", 0)),
        total_s=total,
        text=finished.text,
        extra=extra,
    )


class _TokenClock:
    """A transformers streamer that only records when each new token arrives (no decoding)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first puts the prompt ids
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFRunner:
    """transformers' own pipeline for one checkpoint: its tokenizer and chat template, its image processor
    (the PIL backend: torchvision is not installed), ``Qwen3VLForConditionalGeneration.generate``.

    Qwen3VLProcessor itself cannot be built without torchvision (its video processor needs it), so its
    ``__call__`` is reproduced: expand each ``<|image_pad|>`` to the image's token count, add
    ``mm_token_type_ids``.
    """

    def __init__(self, model_dir: str, dtype: torch.dtype, device: str = "cpu") -> None:
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        self.model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.device = torch.device(device)
        self.image_token_id = int(self.model.config.image_token_id)
        self.image_token = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.merge = int(self.image_processor.merge_size)
        self.attn_implementation = str(self.model.config._attn_implementation)

    def messages(self, text: str, images: tuple[np.ndarray, ...], system_prompt: str | None) -> list[dict]:
        msgs: list[dict] = []
        if system_prompt:
            msgs.append({"role": "system", "content": [{"type": "text", "text": system_prompt}]})
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        msgs.append({"role": "user", "content": content})
        return msgs

    def prepare(self, text: str, images: tuple[np.ndarray, ...], system_prompt: str | None) -> dict[str, torch.Tensor]:
        prompt = self.tokenizer.apply_chat_template(
            self.messages(text, images, system_prompt), add_generation_prompt=True, tokenize=False
        )
        inputs: dict[str, torch.Tensor] = {}
        if images:
            pix = self.image_processor(images=list(images), return_tensors="pt")
            inputs["pixel_values"] = pix["pixel_values"].to(self.model.dtype)
            inputs["image_grid_thw"] = pix["image_grid_thw"]
            parts = prompt.split(self.image_token)
            if len(parts) != len(images) + 1:
                raise ValueError(f"chat template produced {len(parts) - 1} image placeholders for {len(images)} images")
            counts = [int(g.prod()) // (self.merge * self.merge) for g in pix["image_grid_thw"]]
            prompt = parts[0] + "".join(self.image_token * n + rest for n, rest in zip(counts, parts[1:], strict=True))
        enc = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        inputs["input_ids"] = enc["input_ids"]
        inputs["attention_mask"] = enc["attention_mask"]
        if images:
            inputs["mm_token_type_ids"] = (enc["input_ids"] == self.image_token_id).to(torch.int32)
        return {k: v.to(self.device) for k, v in inputs.items()}

    def run(
        self,
        text: str,
        images: tuple[np.ndarray, ...],
        system_prompt: str | None,
        max_new_tokens: int,
        ignore_eos: bool = False,
    ) -> GenTiming:
        """``ignore_eos``: exactly ``max_new_tokens`` tokens, EOS generated like any token (no stop), as the
        engine's option does, so both sides still produce the same greedy tokens."""
        clock = _TokenClock()
        t0 = time.perf_counter()
        inputs = self.prepare(text, images, system_prompt)
        # generate() merges a None eos_token_id with the model's, so the model's own is cleared for the call.
        eos = self.model.generation_config.eos_token_id
        if ignore_eos:
            self.model.generation_config.eos_token_id = None
        try:
            with torch.inference_mode():
                out = self.model.generate(
                    **inputs,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    streamer=clock,
                    top_k=None,
                    top_p=None,
                )
        finally:
            self.model.generation_config.eos_token_id = eos
        total = time.perf_counter() - t0
        if not clock.times:
            raise RuntimeError("transformers generate produced no token")
        n_prompt = int(inputs["input_ids"].shape[1])
        decode_s = clock.times[-1] - clock.times[0]
        n = len(clock.times)
        return GenTiming(
            ttft_s=clock.times[0] - t0,
            decode_tok_s=(n - 1) / decode_s if decode_s > 0 and n > 1 else 0.0,
            token_ids=tuple(int(t) for t in out[0, n_prompt:]),
            prompt_tokens=n_prompt,
            total_s=total,
        )
