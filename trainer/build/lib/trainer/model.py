"""A small GPT, its presets, FSDP2 sharding and deterministic data.

Data is a pure function of (seed, step, rank): a run that restarts from a checkpoint taken at step S
sees exactly the batches an uninterrupted run sees from S on, so both reach the same loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelPreset:
    d_model: int
    n_layers: int
    n_heads: int
    vocab: int
    seq_len: int
    batch_size: int


PRESETS: dict[str, ModelPreset] = {
    # ~1.6M params: several steps/s with 2 ranks on 2 CPU cores.
    "tiny": ModelPreset(d_model=128, n_layers=4, n_heads=4, vocab=2048, seq_len=64, batch_size=8),
    # ~13.6M params: params + AdamW (exp_avg, exp_avg_sq) = ~163 MB across the ranks.
    "small": ModelPreset(d_model=512, n_layers=4, n_heads=8, vocab=1024, seq_len=64, batch_size=8),
    # ~1.0B params, for GPUs.
    "1b": ModelPreset(d_model=2048, n_layers=18, n_heads=16, vocab=32768, seq_len=1024, batch_size=4),
}


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, p: ModelPreset):
        super().__init__()
        self.tok = nn.Embedding(p.vocab, p.d_model)
        self.pos = nn.Embedding(p.seq_len, p.d_model)
        self.layers = nn.ModuleList(Block(p.d_model, p.n_heads) for _ in range(p.n_layers))
        self.ln = nn.LayerNorm(p.d_model)
        self.head = nn.Linear(p.d_model, p.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.layers:
            x = block(x)
        return self.head(self.ln(x))


def build_model(preset: ModelPreset, *, seed: int, device: torch.device) -> nn.Module:
    """Build the model with FSDP2 (``fully_shard``) per block and at the root: each rank keeps a shard."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)  # identical init on every rank and every restart
    if device.type == "cuda":
        with torch.device("meta"):
            model = GPT(preset)
    else:
        model = GPT(preset)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    if device.type == "cuda":
        model.to_empty(device=device)
        torch.manual_seed(seed)
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    return model


def make_batch(preset: ModelPreset, *, seed: int, step: int, rank: int, batch_size: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic batch: a noisy affine bigram rule over the vocabulary.

    Seeded by (seed, step, rank) only, so the data position is the step saved in the checkpoint.
    """
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 4099 + rank)
    n = preset.seq_len + 1
    tok = torch.empty(batch_size, n, dtype=torch.long)
    tok[:, 0] = torch.randint(0, preset.vocab, (batch_size,), generator=g)
    noise = torch.randint(0, preset.vocab, (batch_size, n), generator=g)
    flip = torch.rand(batch_size, n, generator=g) < 0.1
    for t in range(1, n):
        nxt = (tok[:, t - 1] * 5 + 3) % preset.vocab
        tok[:, t] = torch.where(flip[:, t], noise[:, t], nxt)
    tok = tok.to(device)
    return tok[:, :-1], tok[:, 1:]


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
