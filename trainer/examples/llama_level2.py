"""A Llama-style decoder (Hugging Face ``transformers``, built from a config with random weights:
nothing is downloaded) trained as a byte-level language model on text shipped in this repository,
FSDP2 on every decoder layer, at the SDK's full level (Level 2). See ``fsdp_level2.py`` for the
smallest form of the same API.

    torchrun --nproc-per-node 2 trainer/examples/llama_level2.py --steps 100
"""

import argparse
import os
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import unbroken

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


def build_model(seq_len: int) -> torch.nn.Module:
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len,
                         tie_word_embeddings=False)
    torch.manual_seed(0)  # the same initial weights on every rank and every attempt
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def batch(data: torch.Tensor, step: int, rank: int, batch_size: int, seq_len: int) -> torch.Tensor:
    """Windows of the corpus chosen by (step, rank) alone: a resumed run sees the batches an
    uninterrupted one sees."""
    g = torch.Generator().manual_seed(step * 1009 + rank)
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
    return torch.stack([data[s:s + seq_len] for s in starts.tolist()])


@unbroken.entrypoint
def train(ctx: unbroken.Context) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()

    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    ctx.init_process_group()
    model = build_model(args.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = ctx.checkpoint.restore(model=model, optim=opt)

    loss = None
    for step in range(start, args.steps):
        ids = batch(data, step, ctx.rank, args.batch_size, args.seq_len)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        ctx.checkpoint.wait_for_staging()
        opt.step()
        opt.zero_grad()
        ctx.step(step + 1, loss=loss.item(), tokens=ids.numel())
        ctx.checkpoint.maybe_save(step + 1)
        if ctx.rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1} loss {loss.item():.4f}", flush=True)
        if ctx.should_stop():
            ctx.checkpoint.save(step + 1, sync=True)
            break
    if ctx.rank == 0 and loss is not None:
        print(f"FINAL_LOSS {loss.item()!r}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing to download: the model is built from a config
    train()
