"""Benchmark prompt text of a given token length under a checkpoint's tokenizer.

Why measured rather than guessed: context-length sweeps must land on the lengths they claim (128 ...
4096 tokens), and characters-per-token differs between tokenizers.
"""

from __future__ import annotations

from pathlib import Path

WORDS = (
    "the robot arm moves the red cube from the table to the shelf while the camera watches the door and "
    "a small dog walks across the room near the blue chair and the green lamp"
).split()

CHAT_OVERHEAD_TOKENS = 8  # <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n (roughly)


def text_of_tokens(model_dir: Path, n_tokens: int) -> str:
    """Plain text that encodes to about ``n_tokens - CHAT_OVERHEAD_TOKENS`` tokens (never fewer than 1 word)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    target = max(n_tokens - CHAT_OVERHEAD_TOKENS, 1)
    per_round = len(tok.encode(" ".join(WORDS) + " ").ids)
    rounds = max(target // max(per_round, 1) - 1, 0)
    words = list(WORDS) * rounds
    i = 0
    while len(tok.encode(" ".join(words)).ids) < target:
        words.append(WORDS[i % len(WORDS)])
        i += 1
    return " ".join(words)
