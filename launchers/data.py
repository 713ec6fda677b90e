"""Synthetic token batches, seeded: the same (seed, step, micro-batch, dp rank) gives the same tokens
on every framework and every run, so loss curves can be compared across layouts."""
from __future__ import annotations

import torch


def batch(vocab: int, seq_len: int, micro_batch_size: int, seed: int, step: int, micro: int, dp_rank: int,
          dp: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels) of shape (micro_batch_size, seq_len); labels are the tokens shifted by one."""
    g = torch.Generator().manual_seed(hash((seed, step, micro, dp_rank, dp)) & 0x7FFF_FFFF_FFFF_FFFF)
    t = torch.randint(0, vocab, (micro_batch_size, seq_len + 1), generator=g)
    return t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)
