"""The model's embedding tables, built without a random initialisation.

Every weight of the model comes from the checkpoint: the loader builds the modules on the meta device and
then fills them. ``nn.Embedding`` would still draw its normal initialisation there, and on the meta device
``normal_`` goes through torch's Python decompositions, whose first use imports ``torch._dynamo``: about
1.4 s of every node start (measured on the 2-core development VM) spent on numbers that are overwritten.
Handing the module an empty weight skips that draw.
"""

from __future__ import annotations

import torch
from torch import nn


def checkpoint_embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """An ``nn.Embedding`` whose ``[num_embeddings, embedding_dim]`` weight is left empty for the checkpoint."""
    return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
