"""``Member``: the scheduler's record of one request (its run, the events its caller has not read, its phase)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .events import Event

if TYPE_CHECKING:
    from .request import RequestRun


@dataclass(eq=False)
class Member:
    """A request in the scheduler: its run, the events its caller has not read, where it stands."""

    run: RequestRun
    arrival: int  # submission order: the queue's order, preempted requests included
    events: deque[Event] = field(default_factory=deque)
    phase: str = "waiting"  # waiting -> prefill -> decode -> done; a preemption goes back to waiting
    token: int | None = None  # decode: the token to feed next, when the host has it (else it is sampled, unread)
    readmit_after: int | None = None  # preempted: admitted again once more than this many requests finished

    @property
    def done(self) -> bool:
        return self.phase == "done"

    @property
    def preempted(self) -> bool:
        """Waiting again after a preemption: its turn is under way (a sequence, a session turn taken)."""
        return self.phase == "waiting" and self.readmit_after is not None
