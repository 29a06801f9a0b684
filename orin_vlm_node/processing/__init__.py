"""Processing layer: images -> pixel patches, conversations -> prompt ids, generated ids -> text.

ROS-free and model-free (numpy, OpenCV, ``tokenizers``, jinja2, torch only for the output tensors).

- ``ImageProcessor.from_pretrained(dir, min_pixels=None, max_pixels=None)``;
  ``.preprocess(images, color="rgb"|"bgr") -> ImageBatch(pixel_values, grid_thw, num_tokens)``;
  ``.num_image_tokens(h, w)``. Pixel-identical to transformers' Qwen2VLImageProcessorPil.
- ``Tokenizer.from_pretrained(dir)``: ``.encode``, ``.encode_plain``, ``.encode_prompt``, ``.decode``, ``.special``,
  ``.eos_token_ids``.
- ``ChatTemplate.from_pretrained(dir).render(messages, add_generation_prompt=True)`` (sandboxed jinja2,
  built-in ChatML when the checkpoint has no template).
- ``build_prompt_ids(tokenizer, template, messages, image_token_counts, plain_text=True)`` (message text is plain
  text: only the template writes control tokens); ``render_prompt`` (the text and its control spans);
  ``expand_image_pads(ids, pad, counts)``.
- ``IncrementalDetokenizer(tokenizer)``: ``.push(id) -> str``, ``.flush() -> str``.

Errors: ``ImageError``, ``TokenizerError``, ``ChatTemplateError``, ``PromptError`` (all ``ProcessingError``,
a ``ValueError``).
"""

from .chat_template import ChatTemplate, count_images, normalize_messages, render_chatml
from .detokenizer import IncrementalDetokenizer
from .errors import ChatTemplateError, ImageError, ProcessingError, PromptError, TokenizerError
from .image import ImageBatch, ImageProcessor, ImageProcessorConfig, smart_resize, to_rgb
from .prompt import build_prompt_ids, expand_image_pads, render_prompt
from .tokenizer import RenderedPrompt, SpecialTokens, Tokenizer

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "ImageBatch",
    "ImageError",
    "ImageProcessor",
    "ImageProcessorConfig",
    "IncrementalDetokenizer",
    "ProcessingError",
    "PromptError",
    "SpecialTokens",
    "Tokenizer",
    "TokenizerError",
    "build_prompt_ids",
    "render_prompt",
    "RenderedPrompt",
    "count_images",
    "expand_image_pads",
    "normalize_messages",
    "render_chatml",
    "smart_resize",
    "to_rgb",
]
