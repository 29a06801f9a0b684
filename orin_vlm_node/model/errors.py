"""The one exception type of checkpoint handling.

It lives in its own module so that config parsing and weight loading can both raise it without
importing each other. A ``CheckpointError`` always names the file (and keys) at fault, so the node
can log one line a user can act on instead of a stack trace.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """A model directory that cannot be loaded: missing/invalid files, keys or shapes."""
