"""The built-in demo job (presets tiny / small / 1b): a small GPT on a learnable synthetic language,
FSDP2 on every block, at the SDK's full level (Level 2). The product runs it for a job without an
``entrypoint`` (``trainer.launch`` without ``--entrypoint``), through the same shim and the same public
API as your own code; it imports nothing of the product but ``unbroken``.

Data is a pure function of (seed, step, rank): a run that resumes from a checkpoint taken at step S
sees exactly the batches an uninterrupted run sees from S on, so both reach the same loss.

    torchrun --nproc-per-node 2 trainer/examples/synthetic.py --preset tiny --steps 100
"""

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import unbroken


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
    """The model with FSDP2 (``fully_shard``) per block and at the root: each rank keeps a shard."""
    torch.manual_seed(seed)  # identical init on every rank and every attempt
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
    """A learnable synthetic batch: a noisy affine bigram rule over the vocabulary, seeded by
    (seed, step, rank) only, so the data position is the step the checkpoint holds."""
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


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="The built-in demo job: a small GPT on synthetic data.")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default: the preset's)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, help="a progress line every N steps (0 = never)")
    return p.parse_args()


@unbroken.entrypoint
def train(ctx: unbroken.Context) -> float | None:
    args = parse_args()
    preset = PRESETS[args.preset]
    batch_size = args.batch_size or preset.batch_size

    ctx.init_process_group()
    model = build_model(preset, seed=args.seed, device=ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = ctx.checkpoint.restore(model=model, optim=optimizer)
    if ctx.rank == 0:
        print(f"resuming at step {start}" if start else "starting at step 0", flush=True)

    loss_v = None
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        x, y = make_batch(preset, seed=args.seed, step=step, rank=ctx.rank, batch_size=batch_size,
                          device=ctx.device)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss_v = loss.item()  # the one host sync per step
        loss.backward()
        ctx.checkpoint.wait_for_staging()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ctx.step(step + 1, loss=loss_v, tokens=x.numel())
        if step + 1 == args.steps or ctx.should_stop():
            ctx.checkpoint.save(step + 1, sync=True)  # the final checkpoint (also of a graceful stop)
            break
        ctx.checkpoint.maybe_save(step + 1)
        if ctx.rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
            now = time.perf_counter()
            print(f"step {step + 1} loss {loss_v:.4f} ({(now - t0) / args.log_every:.3f} s/step)", flush=True)
            t0 = now
    if ctx.rank == 0 and loss_v is not None:
        print(f"FINAL_LOSS {loss_v!r}\n", end="", flush=True)  # one write: a whole line in the job log
    return loss_v


if __name__ == "__main__":
    train()
