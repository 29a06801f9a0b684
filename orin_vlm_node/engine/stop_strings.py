"""Stop strings over a text stream.

A stop string can arrive split over several tokens ("Obs" + "ervation:"), so text that could still be
the beginning of a stop string is held back instead of streamed; once the stream is known not to
match, it is released. When a stop string completes, the text is cut right before it, and nothing
after it is ever streamed. Holding back means streamed deltas still concatenate to the final text.
"""

from __future__ import annotations


class StopStringMatcher:
    """Feed text deltas, get back the text that is safe to stream and whether a stop string hit."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._pending = ""  # text received but not yet released
        self.stopped = False

    def push(self, text: str) -> str:
        """Add ``text``; return what may be streamed now. After a hit, :attr:`stopped` is True and
        further pushes return ""."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self._pending += text
        hit = -1
        for s in self.stops:
            i = self._pending.find(s)
            if i >= 0 and (hit < 0 or i < hit):
                hit = i
        if hit >= 0:
            self.stopped = True
            out, self._pending = self._pending[:hit], ""
            return out
        keep = self._partial_suffix_len(self._pending)
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        return out

    def flush(self) -> str:
        """End of stream without a hit: release whatever was held back."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        for n in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
