"""Generation engine: requests, sessions, sampling, streaming and the static-buffer decode step.

``Engine(EngineConfig(...))``; ``engine.generate(Request(Turn(text, images)))`` yields ``TextDelta``
events then one ``Finished``; ``Request(..., output=output_format(kind, spec))`` constrains the answer;
``cancel``, ``reset``, ``reconfigure``, ``validate_changes``, ``describe``.
"""

from ..processing.video import Video
from .config import EngineConfig
from .engine import Engine, EngineError
from .events import Event, Finished, FinishReason, Request, SamplingParams, TextDelta, Turn
from .output_format import OutputFormat, output_format

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "Event",
    "FinishReason",
    "Finished",
    "OutputFormat",
    "Request",
    "SamplingParams",
    "TextDelta",
    "Turn",
    "Video",
    "output_format",
]
