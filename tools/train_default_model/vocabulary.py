"""The tokenizer and chat template the default model is trained with (byte-level BPE over the data set's strings)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from support import synthetic_scenes as scenes

from .recipe import TrainConfig

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


# Our own ChatML template in the Qwen3-VL instruct format: no default system prompt, images and videos as
# <|vision_start|><|image_pad|><|vision_end|> (the processor expands the pad), optional "Picture N: " ids.
CHAT_TEMPLATE = (
    "{%- set counter = namespace(image=0, video=0) -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] is defined and part['type'] in ('image', 'image_url') -%}"
    "{%- set counter.image = counter.image + 1 -%}"
    "{%- if add_vision_id is defined and add_vision_id -%}{{- 'Picture ' ~ counter.image ~ ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] is defined and part['type'] == 'video' -%}"
    "{%- set counter.video = counter.video + 1 -%}"
    "{%- if add_vision_id is defined and add_vision_id -%}{{- 'Video ' ~ counter.video ~ ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['text'] is defined -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def build_tokenizer(cfg: TrainConfig):
    """Byte-level BPE trained on every dataset string (weighted by how often training draws them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = np.random.default_rng([scenes.TRAIN_NAMESPACE, cfg.seed, 10**9])
    corpus = scenes.all_texts() * 3
    corpus += ["user\n", "assistant\n", "system\n", "You are a helpful assistant."] * 50
    for _ in range(1000):  # question/answer frequencies as training draws them (images ignored)
        s = scenes.sample(rng)
        corpus += [s.question, s.answer]
    # Every non-ASCII character on its own, often: its bytes merge into one token before any merge across
    # characters, so no token ever holds a partial character.
    chars = sorted({c for text in corpus for c in text if ord(c) > 127})
    corpus += chars * 200
    tok.train_from_iterator(corpus, trainer=trainer)
    check_whole_characters(tok)
    return tok


def check_whole_characters(tok) -> None:
    """Every dataset string must tokenize into tokens that each decode to whole UTF-8 characters, so Chinese
    answers stream as whole characters even where a detokenizer emits one token at a time."""
    for text in scenes.all_texts():
        for tid in tok.encode(text).ids:
            piece = tok.decode([tid])
            if "\ufffd" in piece:
                raise RuntimeError(f"{text!r}: token {tid} ({tok.id_to_token(tid)!r}) splits a character")


def write_tokenizer_files(tok, out: Path) -> dict[str, int]:
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_end|>")],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return ids
