"""DeepSpeed-Ulysses: an all-to-all trades the sequence split for a head split, attention runs
over the whole sequence, and a second all-to-all trades back (``parallelism.cp_method: ulysses``).

Runs on every rank of a cp group, called by ``SequenceShard.attend``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.context_parallel import SequenceShard


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard, documents: torch.Tensor | None
) -> torch.Tensor:
    """See ``SequenceShard.attend`` for the arguments and the result."""
    raise NotImplementedError("cp_method ulysses is not built yet")
