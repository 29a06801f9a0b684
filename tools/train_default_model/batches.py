"""Training batches built exactly as the runtime builds its inputs: pixels from the runtime's own image and video
processors, prompt ids from the ChatML text with the image pad expanded or the video placeholder replaced by its
timestamped frame groups."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from support import scene_videos as videos
from support import synthetic_scenes as scenes


class Pixels:
    """Turns HWC uint8 RGB images into (pixel_values (N,1536) f32, grid_thw (n,3) long, tokens per image)."""

    def __init__(self, model_dir: Path, allow_fallback: bool) -> None:
        try:
            from orin_vlm_node.processing import ImageProcessor

            self._proc = ImageProcessor.from_pretrained(str(model_dir))
            self.kind = "orin_vlm_node.processing.ImageProcessor"
        except ImportError:
            if not allow_fallback:
                raise
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            self._hf = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
            self._proc = None
            self.kind = "transformers Qwen2VLImageProcessorPil (fallback)"

    def __call__(self, images: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        if self._proc is not None:
            batch = self._proc.preprocess(images, color="rgb")
            return batch.pixel_values, batch.grid_thw, list(batch.num_tokens)
        from PIL import Image

        out = self._hf([Image.fromarray(im) for im in images], return_tensors="pt")
        grid = out["image_grid_thw"]
        return out["pixel_values"].float(), grid, [int(t * h * w) // 4 for t, h, w in grid.tolist()]


class Encoder:
    """Prompt/answer token ids exactly as the runtime builds them (template text, then pad expansion)."""

    def __init__(self, tok, ids: dict[str, int]) -> None:
        self.tok = tok
        self.ids = ids
        self._cache: dict[str, tuple[list[int], list[int]]] = {}  # text -> (token ids, first character of each)

    def _encoded(self, text: str) -> tuple[list[int], list[int]]:
        if text not in self._cache:
            enc = self.tok.encode(text)
            self._cache[text] = (enc.ids, [a for a, _ in enc.offsets])
        return self._cache[text]

    def _enc(self, text: str) -> list[int]:
        return self._encoded(text)[0]

    def answer_starts(self, answer: str) -> list[int]:
        """The first character of each token of ``answer(answer)``, and ``len(answer)`` for its <|im_end|>."""
        return self._encoded(answer)[1] + [len(answer)]

    def prompt_text(self, question: str, image: bool) -> tuple[str, list[int]]:
        """The user turn's template text (one image pad) and the first character of each of its tokens."""
        vision = "<|vision_start|><|image_pad|><|vision_end|>" if image else ""
        text = f"<|im_start|>user\n{vision}{question}<|im_end|>\n<|im_start|>assistant\n"
        return text, self._encoded(text)[1]

    def prompt(self, question: str, n_image_tokens: int | None) -> list[int]:
        ids = self._enc(self.prompt_text(question, n_image_tokens is not None)[0])
        if n_image_tokens is None:
            return list(ids)
        pad = self.ids["<|image_pad|>"]
        i = ids.index(pad)
        return ids[:i] + [pad] * n_image_tokens + ids[i + 1 :]

    def video_prompt(self, question: str, video) -> list[int]:
        """A question about a clip (``video``: its ``VideoLayout``), the clip's frame groups where the template
        puts the video, laid out by the runtime's own rule."""
        from orin_vlm_node.processing.prompt import frame_group_ids

        head, tail = self._enc("<|im_start|>user\n"), self._enc(f"{question}<|im_end|>\n<|im_start|>assistant\n")
        ids = self.ids
        groups = frame_group_ids(video, self._enc, ids["<|vision_start|>"], ids["<|video_pad|>"], ids["<|vision_end|>"])
        return head + groups + tail

    def answer(self, answer: str) -> list[int]:
        return self._enc(answer) + [self.ids["<|im_end|>"]]


def make_batch(samples: list[scenes.Sample], enc: Encoder, pixels: Pixels) -> dict[str, torch.Tensor]:
    images = [s.image for s in samples if s.image is not None]
    pv, grid, ntok = pixels(images) if images else (None, None, [])
    prompts = []
    k = 0
    for s in samples:
        n = None
        if s.image is not None:
            n = ntok[k]
            k += 1
        prompts.append(enc.prompt(s.question, n))
    batch = _padded(prompts, [enc.answer(s.answer) for s in samples], enc)
    if pv is not None:
        batch["pixel_values"] = pv
        batch["image_grid_thw"] = grid
    return batch


def make_video_batch(clips: list[videos.Clip], enc: Encoder, processor) -> tuple[dict[str, torch.Tensor], list]:
    """A batch of questions about clips, each clip one video (``processor``: the runtime's VideoProcessor; the
    model takes each video's frame groups as one (groups, h, w) grid, as transformers' video processor gives),
    and how each clip was sent (its ``VideoLayout``)."""
    from orin_vlm_node.processing import Video

    out = processor.preprocess([Video(c.frames, c.times) for c in clips])
    layouts = zip(clips, out.layouts, strict=True)
    prompts = [enc.video_prompt(c.question, v) for c, v in layouts]
    batch = _padded(prompts, [enc.answer(c.answer) for c in clips], enc)
    patch = processor.config.patch_size
    batch["pixel_values_videos"] = out.groups.pixel_values
    batch["video_grid_thw"] = torch.tensor(
        [[len(v.timestamps), v.size[0] // patch, v.size[1] // patch] for v in out.layouts]
    )
    return batch, out.layouts


def _padded(prompts: list[list[int]], answers: list[list[int]], enc: Encoder) -> dict[str, torch.Tensor]:
    """Prompt + answer rows, right-padded; labels only on the answers; the pads' modality types."""
    seqs = [p + a for p, a in zip(prompts, answers, strict=True)]
    labels = [[-100] * len(p) + a for p, a in zip(prompts, answers, strict=True)]
    length = max(len(x) for x in seqs)
    pad = enc.ids["<|endoftext|>"]
    input_ids = torch.full((len(seqs), length), pad, dtype=torch.long)
    label_t = torch.full((len(seqs), length), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, (x, y) in enumerate(zip(seqs, labels, strict=True)):
        input_ids[i, : len(x)] = torch.tensor(x)
        label_t[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    types = (input_ids == enc.ids["<|image_pad|>"]).long() + 2 * (input_ids == enc.ids["<|video_pad|>"]).long()
    return {"input_ids": input_ids, "attention_mask": mask, "labels": label_t, "mm_token_type_ids": types}
