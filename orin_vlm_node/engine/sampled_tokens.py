"""Tokens chosen on the device from one decode step, on their way to the host.

Why: on a GPU the decode step is launched, not run, by the host; reading the chosen token back waits
for the step to end, and everything the host does next (streaming the token's text, checking stop
strings, staging the next step) leaves the GPU idle unless the next step is already queued. With
overlap, the scheduler stages the device tokens themselves as the next step's input (a device-to-device
copy), launches that step, and only then reads these tokens: the host's work for token N runs while the
GPU computes token N+1. The copy to the host starts when the tokens are sampled (pinned memory, no
wait) so reading them later costs only the wait for that copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

import torch

M = TypeVar("M")


class SampledTokens(Generic[M]):
    """One token per member of a decode step, sampled on the device and not yet read by the host.

    ``staged``: the members whose token already went into the next decode step as its input (their KV
    slot is reserved; the host feeds it to the session once it has read it).
    """

    def __init__(self, members: Sequence[M], tokens: Sequence[torch.Tensor]):
        self.members = list(members)
        self.tokens = torch.stack(list(tokens))  # (B,) long on the device, in member order
        self.staged: set[M] = set()
        self._ready: torch.cuda.Event | None = None
        if self.tokens.is_cuda:
            self._host = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True)
            self._host.copy_(self.tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = self.tokens

    def row(self, member: M) -> torch.Tensor:
        """``member``'s token as a () device tensor (a view: staging copies it on the device)."""
        return self.tokens[self.members.index(member)]

    def read(self) -> list[int]:
        """The tokens as the host sees them; waits only for their copy, not for later work on the stream."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()
