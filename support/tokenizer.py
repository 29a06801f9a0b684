"""A tiny byte-level BPE tokenizer with Qwen3-VL's special tokens, written to disk for tests.

Why: the real Qwen tokenizer (151k tokens) cannot be downloaded in tests, but the code paths that
matter (byte-level BPE with partial-UTF-8 tokens, special tokens recognised inside text, chat
template rendering, image placeholder expansion) only need a tokenizer built the same way. The
special tokens sit at FIXED low ids so tiny checkpoints (vocab_size 1024, see support.checkpoints)
can use them as image/vision token ids.

Usage: ``ids = write_tiny_tokenizer(tmp_path)`` writes ``tokenizer.json`` and
``tokenizer_config.json`` (with a ChatML Qwen3-VL style ``chat_template``) into ``tmp_path`` and
returns ``{"<|im_start|>": 1, ...}``. The output is deterministic (same bytes every call).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Fixed ids; training adds them first in this order, so token i gets id i.
SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": 0,
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "<|vision_start|>": 3,
    "<|vision_end|>": 4,
    "<|vision_pad|>": 5,
    "<|image_pad|>": 6,
    "<|video_pad|>": 7,
}

VOCAB_SIZE = 1000  # <= 1024, the tiny checkpoints' embedding rows

# Small mixed corpus: English, Chinese (3-byte UTF-8) and emoji (4-byte UTF-8, some with ZWJ) so the
# trained merges produce tokens that hold partial characters as well as whole ones.
_CORPUS: list[str] = [
    "Describe this image in detail.",
    "The robot arm picks up the red cube and places it on the table.",
    "What objects are in front of the camera? There is a chair, a door and a small dog.",
    "A person is walking across the street while cars wait at the traffic light.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps again.",
    "Hello, world! How are you today? I am fine, thank you very much.",
    "Navigation goal reached. Obstacle detected at 1.5 meters on the left side.",
    "Count the number of people in the picture and tell me what they are doing.",
    "def main():\n    print('hello')\n    return 0\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159",
    "请描述这张图片。",
    "机器人正在房间里移动，前方有一把椅子和一张桌子。",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "图片中有几个人？他们在做什么？",
    "这是一只猫，它正在沙发上睡觉。",
    "视觉语言模型可以理解图像和文本。",
    "Emoji test: 😀 😃 😄 😁 😆 🤖 🚗 🐶 🐱 ❤️ 👍 🎉 🌍",
    "Family: 👨‍👩‍👧‍👦 flags: 🇨🇳 🇺🇸 🇩🇪 skin tones: 👋🏻 👋🏽 👋🏿",
    "Mixed 混合 text 文本 with 表情 😀🤖 and English words.",
    "Café naïve résumé façade — “quotes” and ‘single’ … ellipsis.",
]


def _chat_template() -> str:
    """A ChatML template with Qwen3-VL Instruct semantics (no default system prompt).

    Written for these tests; exercises string and list content, image/video parts, add_vision_id,
    tool results and the generation prompt.
    """
    return (
        "{%- set image_count = namespace(value=0) -%}\n"
        "{%- set video_count = namespace(value=0) -%}\n"
        "{%- for message in messages -%}\n"
        "{%- if message.role == 'tool' -%}\n"
        "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' -}}\n"
        "{%- else -%}\n"
        "{{- '<|im_start|>' + message.role + '\\n' -}}\n"
        "{%- if message.content is string -%}\n"
        "{{- message.content -}}\n"
        "{%- else -%}\n"
        "{%- for part in message.content -%}\n"
        "{%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}\n"
        "{%- set image_count.value = image_count.value + 1 -%}\n"
        "{%- if add_vision_id -%}{{- 'Picture ' + image_count.value|string + ': ' -}}{%- endif -%}\n"
        "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}\n"
        "{%- elif part.type == 'video' or 'video' in part -%}\n"
        "{%- set video_count.value = video_count.value + 1 -%}\n"
        "{%- if add_vision_id -%}{{- 'Video ' + video_count.value|string + ': ' -}}{%- endif -%}\n"
        "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}\n"
        "{%- elif 'text' in part -%}\n"
        "{{- part.text -}}\n"
        "{%- endif -%}\n"
        "{%- endfor -%}\n"
        "{%- endif -%}\n"
        "{{- '<|im_end|>\\n' -}}\n"
        "{%- endif -%}\n"
        "{%- endfor -%}\n"
        "{%- if add_generation_prompt -%}\n"
        "{{- '<|im_start|>assistant\\n' -}}\n"
        "{%- endif -%}\n"
    )


def build_tiny_tokenizer() -> Tokenizer:
    """Train the tiny byte-level BPE in memory (deterministic: fixed corpus, single pass)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 3, trainer=trainer)
    # Already in the vocab at their ids; this marks them as special "added tokens" so they are
    # matched whole inside text and skipped by decode(skip_special_tokens=True).
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    for text, want in SPECIAL_TOKENS.items():
        got = tok.token_to_id(text)
        if got != want:
            raise RuntimeError(f"tiny tokenizer: {text} got id {got}, expected {want}")
    return tok


def write_tiny_tokenizer(path: str | Path) -> dict[str, int]:
    """Write tokenizer.json + tokenizer_config.json into ``path``; return the special token ids."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(i): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for text, i in SPECIAL_TOKENS.items()
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": _chat_template(),
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return dict(SPECIAL_TOKENS)
