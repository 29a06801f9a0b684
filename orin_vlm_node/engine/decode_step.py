"""The decode step, split so a CUDA graph can replay it: ``prepare`` on the host, ``run`` on the device.

Why the split: a captured graph replays fixed kernels on fixed addresses. Everything that changes from
one token to the next (the input token, the RoPE position, the KV slot, the block table when the
sequence crosses a page boundary) must therefore live in tensors allocated once, and must be written
*before* the replay, by ordinary host code. Forgetting the block allocation there is the classic
"garbage after the first page boundary" bug of paged attention under graphs: here ``prepare`` always
goes through ``KVCache.prepare_static_decode``, which allocates the block and uploads the table row.

``run`` only reads the fixed buffers: the model forward for one token with the cache's static
attention. On CPU it executes eagerly (the same code path, so tests check the design without a GPU);
on CUDA the engine hands it to the graph runner, which captures it once and replays it per token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kvcache import KVCache
from ..model.positions import decode_positions


class StaticDecodeStep:
    """Fixed buffers + the two halves of a one-token decode step for one KV cache."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, device: torch.device):
        self.model = model
        self.cache = cache
        self.device = device
        self.buffers = cache.new_static_decode_buffers()
        self.input_ids = torch.zeros(1, dtype=torch.long, device=device)  # (1,)
        self.positions = torch.zeros((3, 1), dtype=torch.long, device=device)  # (3, 1)
        self.attention = cache.static_decode_attention(self.buffers)
        self.graph: Callable[[], torch.Tensor] | None = None  # replay function once captured

    def prepare(self, seq: int, token_id: int, rope_delta: int) -> None:
        """Host half: reserve the next slot (may raise PoolExhausted before any change) and fill buffers.

        The token goes to KV slot ``s = length(seq)`` and RoPE position ``s + rope_delta`` (all three
        M-RoPE streams), so positions keep running behind slots after an image.
        """
        slot = self.cache.length(seq)
        self.cache.prepare_static_decode(seq, self.buffers)
        self.input_ids.fill_(token_id)
        self.positions.fill_(slot + rope_delta)

    def forward(self) -> torch.Tensor:
        """Device half, eager: (1, vocab) logits; reads only the fixed buffers (what a graph captures)."""
        return self.model.forward(self.input_ids, self.positions, self.attention)

    def run(self) -> torch.Tensor:
        """Replay the captured graph if there is one, else run eagerly. Returns (1, vocab) logits; with
        a graph the tensor is the graph's static output, valid until the next replay."""
        return self.graph() if self.graph is not None else self.forward()


def dynamic_decode(model: torch.nn.Module, cache: KVCache, seq: int, token_id: int, rope_delta: int) -> torch.Tensor:
    """The ordinary decode step (fresh tensors, ``cache.step``): the reference the static step must match."""
    slot = cache.length(seq)
    attn = cache.step(seq, 1)
    device = model.device
    ids = torch.tensor([token_id], dtype=torch.long, device=device)
    positions = decode_positions(slot, rope_delta, device=device)
    return model.forward(ids, positions, attn)
