"""Processing layer: images -> pixel patches, conversations -> prompt ids, generated ids -> text.

ROS-free and model-free (numpy, OpenCV, ``tokenizers``, jinja2, torch only for the output tensors).

More in docs/modules.md, ``orin_vlm_node/processing/__init__.py``.
"""

from .chat_template import ChatTemplate, count_images, normalize_messages, render_chatml
from .detokenizer import IncrementalDetokenizer, token_spans
from .errors import ChatTemplateError, ImageError, ProcessingError, PromptError, TokenizerError
from .image import ImageBatch, ImageProcessor, ImageProcessorConfig, smart_resize, to_rgb
from .prompt import build_prompt_ids, expand_image_pads, render_prompt
from .tokenizer import RenderedPrompt, SpecialTokens, Tokenizer
from .video import Video, VideoBatch, VideoLayout, VideoProcessor

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
    "Video",
    "VideoBatch",
    "VideoLayout",
    "VideoProcessor",
    "build_prompt_ids",
    "render_prompt",
    "RenderedPrompt",
    "count_images",
    "expand_image_pads",
    "normalize_messages",
    "render_chatml",
    "smart_resize",
    "to_rgb",
    "token_spans",
]
