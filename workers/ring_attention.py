"""Ring attention: keys and values pass around the cp ring while each rank attends to the block
it holds (``parallelism.cp_method: ring``).

Runs on every rank of a cp group, called by ``SequenceShard.attend``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.context_parallel import SequenceShard


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard, documents: torch.Tensor | None
) -> torch.Tensor:
    """See ``SequenceShard.attend`` for the arguments and the result."""
    raise NotImplementedError("cp_method ring is not built yet")
