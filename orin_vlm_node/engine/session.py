"""Sessions: what a multi-turn conversation keeps between requests, and the store that bounds them.

A session owns one KV sequence. Its KV holds every token the model has seen so far (system prompt,
user turns with their image tokens, the assistant answers) so turn N only prefills what it adds.
Three things must stay consistent with that KV, and live here together so they cannot drift apart:

More in docs/modules.md, ``orin_vlm_node/engine/session.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field

from ..kvcache import KVCache

log = logging.getLogger("orin_vlm_node.engine")


@dataclass(frozen=True)
class SessionSnapshot:
    """A session as it was before a turn started: enough to undo the turn exactly."""

    kv_length: int
    num_tokens: int
    pending_ids: tuple[int, ...]
    messages: tuple[dict, ...]
    answer: str
    rope_delta: int
    turns: int


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

    def snapshot(self, kv_length: int) -> SessionSnapshot:
        return SessionSnapshot(
            kv_length,
            len(self.token_ids),
            tuple(self.pending_ids),
            tuple(self.messages),
            self.answer,
            self.rope_delta,
            self.turns,
        )

    def restore(self, snap: SessionSnapshot, cache: KVCache) -> None:
        """Undo a turn: the KV, the token lists and the conversation go back to ``snap``."""
        cache.truncate(self.seq, snap.kv_length)
        del self.token_ids[snap.num_tokens :]
        del self.extra_keys[snap.num_tokens :]
        self.pending_ids, self.messages, self.answer = list(snap.pending_ids), list(snap.messages), snap.answer
        self.rope_delta, self.turns = snap.rope_delta, snap.turns

    def append(self, ids: Sequence[int], extra_keys: Sequence[Hashable | None]) -> None:
        """Tokens whose KV the sequence now holds."""
        self.token_ids.extend(ids)
        self.extra_keys.extend(extra_keys)
        self.touch()

    def close_answer(self, last_token: int | None, text: str, eos_ids: Sequence[int], im_end: int) -> None:
        """After a finished turn: the tokens still to feed (last sampled token unless EOS, ``<|im_end|>``)."""
        self.pending_ids = [im_end] if last_token is None or last_token in eos_ids else [last_token, im_end]
        self.answer = text

    def touch(self) -> None:
        self.last_used = time.monotonic()


class SessionStore:
    """The sessions whose KV is kept, bounded by ``max_sessions``; dropping one frees its KV."""

    def __init__(self, cache: KVCache, max_sessions: int) -> None:
        self.cache = cache
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def ids(self) -> list[str]:
        return list(self._sessions)

    def get(self, session_id: str | None) -> Session | None:
        return self._sessions.get(session_id) if session_id else None

    def keep(self, session: Session) -> None:
        self._sessions[session.session_id] = session

    def kept(self, session: Session | None) -> bool:
        return session is not None and self._sessions.get(session.session_id) is session

    def drop(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self.cache.release(session.seq)

    def drop_all(self) -> None:
        for session_id in list(self._sessions):
            self.drop(session_id)

    def forget_all(self) -> None:
        """After the cache itself was cleared: the sessions' sequences no longer exist."""
        self._sessions.clear()

    def evict_one(self, busy: Collection[str]) -> bool:
        """Free the least recently used idle session (never one of ``busy``, the ids whose requests are
        running or waiting); False when there is none."""
        victims = [s for s in self._sessions.values() if s.session_id not in busy]
        if not victims:
            return False
        victim = min(victims, key=lambda s: s.last_used)
        log.warning("KV pool full: dropping idle session %r to make room", victim.session_id)
        self.drop(victim.session_id)
        return True

    def trim(self, busy: Collection[str]) -> None:
        """At most ``max_sessions`` kept (the pool is sized for that many): least recently used idle ones
        go first; sessions of ``busy`` requests stay until those end."""
        while len(self._sessions) > self.max_sessions:
            idle = [s for s in self._sessions.values() if s.session_id not in busy]
            if not idle:
                return
            victim = min(idle, key=lambda s: s.last_used)
            log.info("more than max_sessions=%d sessions: dropping %r", self.max_sessions, victim.session_id)
            self.drop(victim.session_id)
