"""Packing a rank's tensors into bounded flat chunks for collectives.

Runs on every rank, called by the trainer: the replica sync broadcasts a stage's state in flat
chunks of bounded size (a whole stage at once would not fit next to the live state). Nothing
here communicates.
"""

from __future__ import annotations

import torch

# One slice [start, stop) of a tensor's flattened elements.
Piece = tuple[torch.Tensor, int, int]


def flat_chunks(tensors: list[torch.Tensor], max_elements: int) -> list[list[Piece]]:
    """Pack the tensors' elements, in order, into chunks of at most ``max_elements``."""
    chunks: list[list[Piece]] = [[]]
    room = max_elements
    for tensor in tensors:
        start = 0
        while start < tensor.numel():
            if room == 0:
                chunks.append([])
                room = max_elements
            stop = min(tensor.numel(), start + room)
            chunks[-1].append((tensor, start, stop))
            room -= stop - start
            start = stop
    return [chunk for chunk in chunks if chunk]


def scatter_back(flat: torch.Tensor, pieces: list[Piece]) -> None:
    """Copy a received chunk into the tensor slices it was packed from (contiguous shards)."""
    offset = 0
    for tensor, start, stop in pieces:
        tensor.view(-1)[start:stop].copy_(flat[offset : offset + stop - start])
        offset += stop - start
