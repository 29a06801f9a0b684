"""Session bookkeeping: what a multi-turn conversation keeps between requests.

A session owns one KV sequence. Its KV holds every token the model has seen so far (system prompt,
user turns with their image tokens, the assistant answers) so turn N only prefills what it adds.
Three things must stay consistent with that KV, and live here together so they cannot drift apart:

* ``token_ids`` / ``extra_keys``: the tokens whose KV is cached, slot by slot (extra key = image
  content hash for image-pad tokens, used for prefix-cache registration);
* ``rope_delta``: RoPE position minus KV slot after the cached tokens (next RoPE position is
  ``len(token_ids) + rope_delta``); it is negative once an image was shown, in any earlier turn;
* ``pending_ids``: tokens that belong to the conversation but are not in the KV yet: the last
  sampled token (a sampled token is only fed to the model by the *next* step) and the ``<|im_end|>``
  that closes the answer. The next turn prefills them in front of its own tokens.

``messages`` is the conversation in chat-template form, used to render the next turn's delta.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass
class Session:
    session_id: str
    seq: int  # KV sequence handle
    token_ids: list[int] = field(default_factory=list)
    extra_keys: list[Hashable | None] = field(default_factory=list)
    rope_delta: int = 0
    pending_ids: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    answer: str = ""  # text of the last assistant answer (rendered into the next turn's history)
    turns: int = 0
    last_used: float = field(default_factory=time.monotonic)

    @property
    def next_position(self) -> int:
        """RoPE position of the next token after the cached ones."""
        return len(self.token_ids) + self.rope_delta

    def context_tokens(self) -> int:
        """Tokens of the conversation so far, cached or pending."""
        return len(self.token_ids) + len(self.pending_ids)

    def touch(self) -> None:
        self.last_used = time.monotonic()
