"""The transformer benchmark's torch side: the example's model in torch, pipelined by
``torch.distributed.pipelining`` (1F1B) with DDP over the data axis, on gloo.

Launched by ``run.py`` (torch is no dependency of this package)::

    torchrun --standalone --nproc-per-node 4 benchmarks/transformer/torch_bench.py \
        --stages 2 --data 2 --out r.json

The model is the example's (``python -m jax_cpu_mpi.examples.transformer``): token and
position embeddings, ``--layers`` pre-norm blocks (causal self-attention, a GELU MLP of
4 x width, dropout after each), a final norm and a head; the same parameter count and
init scale (embeddings N(0, 0.02), kernels of variance 1 / fan-in, biases 0). The ranks
form a ``stage x data`` mesh: the ``--data`` ranks of a stage hold its blocks (the
embedding on the first stage, head and loss on the last) wrapped in DDP over their data
group; ``Schedule1F1B`` (``ScheduleInterleaved1F1B`` for ``--virtual-stages`` > 1) runs
``--microbatches`` microbatches of each rank's share of the batch. A step is the
example's: loss and gradients, clipping to a global norm (over the stages), AdamW with a
warm-up and cosine schedule.

Before timing, one step's loss and gradients (dropout off: torch draws dropout masks from
each process's generator, so a pipelined step cannot draw the same masks as one
unpipelined model) are compared with the same torch model unpipelined on the whole batch
(exit 1 when they differ by more than float32 rounding); then dropout is set to
``--dropout`` for the timed steps. The tokens are random ids over the example's vocabulary
size (a step's time does not depend on them). Every process runs
``torch.set_num_threads(--threads)`` (default: the machine's cores / processes). Rank 0
writes the JSON: every timed step's seconds (rank 0's wall clock, after a barrier before
each step) and every rank's peak RSS (``getrusage``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from torch.nn.parallel import DistributedDataParallel


class Block(nn.Module):
    """The example's pre-norm block: causal self-attention, then an MLP, each residual."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, W = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(W, dim=-1)
        heads = lambda a: a.view(B, T, self.heads, W // self.heads).transpose(1, 2)  # noqa: E731
        att = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(B, T, W)))
        return x + self.drop(self.down(F.gelu(self.up(self.norm2(x)))))


class Chunk(nn.Module):
    """Consecutive blocks, with the embeddings before them (first chunk) and the final
    norm and head after them (last chunk)."""

    def __init__(self, blocks: list[Block], embed: tuple[nn.Embedding, nn.Embedding] | None,
                 head: tuple[nn.LayerNorm, nn.Linear] | None) -> None:
        super().__init__()
        self.tokens, self.positions = embed if embed else (None, None)
        self.blocks = nn.ModuleList(blocks)
        self.norm, self.out = head if head else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tokens is not None:
            x = self.tokens(x) + self.positions(torch.arange(x.shape[-1]))
        for block in self.blocks:
            x = block(x)
        if self.out is not None:
            x = self.out(self.norm(x))
        return x


def make_model(a: argparse.Namespace) -> list[Chunk]:
    """The whole model from ``--seed``, cut into ``stages x virtual`` chunks."""
    torch.manual_seed(a.seed)
    embed = (nn.Embedding(a.vocab, a.width), nn.Embedding(a.seq_len, a.width))
    blocks = [Block(a.width, a.heads, a.dropout) for _ in range(a.layers)]
    head = (nn.LayerNorm(a.width), nn.Linear(a.width, a.vocab))
    for e in embed:
        nn.init.normal_(e.weight, std=0.02)
    for m in [*blocks, head[1]]:
        for lin in m.modules():
            if isinstance(lin, nn.Linear):  # flax's lecun_normal scale, zero biases
                nn.init.normal_(lin.weight, std=1 / math.sqrt(lin.in_features))
                nn.init.zeros_(lin.bias)
    n = a.stages * a.virtual_stages
    per = a.layers // n
    return [Chunk(blocks[c * per:(c + 1) * per], embed if c == 0 else None,
                  head if c == n - 1 else None) for c in range(n)]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def set_dropout(chunks: list[nn.Module], rate: float) -> None:
    for c in chunks:
        for m in c.modules():
            if isinstance(m, nn.Dropout):
                m.p = rate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torch_bench.py")
    a = p.add_argument
    a("--stages", type=int, default=2)
    a("--data", type=int, default=2)
    a("--virtual-stages", type=int, default=1)
    a("--microbatches", type=int, default=4)
    a("--layers", type=int, default=4)
    a("--width", type=int, default=128)
    a("--heads", type=int, default=4)
    a("--seq-len", type=int, default=64)
    a("--batch", type=int, default=32)
    a("--dropout", type=float, default=0.1)
    a("--vocab", type=int, default=96)
    a("--seed", type=int, default=0)
    a("--lr", type=float, default=3e-3)
    a("--warmup-steps", type=int, default=2, help="untimed steps")
    a("--steps", type=int, default=10, help="timed steps")
    a("--threads", type=int, default=0)
    a("--out", required=True)
    return p.parse_args(argv)


def main() -> int:
    a = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != a.stages * a.data:
        raise SystemExit(f"torch_bench: {world} processes for {a.stages} stages x {a.data} "
                         "data shards")
    threads = a.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    # Rank = stage * data + shard, as the JAX mesh (stage-major).
    stage, shard = divmod(rank, a.data)
    pp_group = dp_group = None
    for s in range(a.stages):  # every rank creates every group, in the same order
        g = dist.new_group([s * a.data + d for d in range(a.data)])
        if s == stage:
            dp_group = g
    for d in range(a.data):
        g = dist.new_group([s * a.data + d for s in range(a.stages)])
        if d == shard:
            pp_group = g

    M, B, T, D, V = a.microbatches, a.batch, a.seq_len, a.data, a.virtual_stages
    gen = torch.Generator().manual_seed(a.seed + 1)
    ids = torch.randint(0, a.vocab, (B, T + 1), generator=gen)
    ids, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    # The reference: the whole model, unpipelined, on the whole batch, dropout off.
    reference = make_model(a)
    set_dropout(reference, 0.0)
    x = ids
    for c in reference:
        x = c(x)
    want = cross_entropy(x, targets)
    want.backward()
    want_loss = float(want.detach())

    chunks = make_model(a)
    n_chunks = a.stages * V
    mine = [stage + v * a.stages for v in range(V)]  # looping placement, as torch expects
    modules = {c: (DistributedDataParallel(chunks[c], process_group=dp_group) if D > 1
                   else chunks[c]) for c in mine}
    stages = [PipelineStage(modules[c], c, n_chunks, torch.device("cpu"), group=pp_group)
              for c in mine]
    # scale_grads (the default) divides the microbatches' summed gradients by M: the
    # gradient of the mean loss; DDP averages over the data shards.
    schedule = (ScheduleInterleaved1F1B(stages, n_microbatches=M, loss_fn=cross_entropy)
                if V > 1 else Schedule1F1B(stages[0], n_microbatches=M,
                                           loss_fn=cross_entropy))
    # This shard's part of each microbatch, as the JAX side's data axis takes it.
    local = lambda t: t.reshape(M, D, B // (M * D), T)[:, shard].reshape(-1, T)  # noqa: E731
    my_ids, my_targets = local(ids), local(targets)
    params = [p for c in mine for p in chunks[c].parameters()]
    decay = [p for c in mine for n, p in chunks[c].named_parameters()
             if n.endswith("weight") and p.dim() == 2]
    rest = [p for p in params if all(p is not q for q in decay)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": rest, "weight_decay": 0.0}], lr=a.lr)
    # The example's schedule: 30 steps' warm-up, cosine decay to a tenth at step 300.
    lr_at = lambda i: (i + 1) / 30 if i < 30 else \
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (i - 30) / 270)))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)

    def forward_backward() -> list[torch.Tensor]:
        for c in mine:
            chunks[c].zero_grad(set_to_none=False)
        losses: list[torch.Tensor] = []
        args = (my_ids,) if 0 in mine else ()
        kwargs = {"target": my_targets, "losses": losses} if n_chunks - 1 in mine else {}
        schedule.step(*args, **kwargs)
        return losses

    def train_step() -> None:
        forward_backward()
        # Clipping to the global norm: every stage's squares summed over the stages (a
        # stage's data shards hold the same, averaged gradients).
        sq = torch.stack([p.grad.pow(2).sum() for p in params]).sum()
        dist.all_reduce(sq, group=pp_group)
        scale = torch.clamp(1.0 / (sq.sqrt() + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(scale)
        optimizer.step()
        scheduler.step()

    # The check: one step's loss and gradients with dropout off.
    set_dropout(chunks, 0.0)
    losses = forward_backward()
    ref_params = {id(p): q for c in mine for p, q in zip(chunks[c].parameters(),
                                                           reference[c].parameters(),
                                                           strict=True)}
    worst = 0.0
    for p in params:
        want = ref_params[id(p)].grad
        scale = float(want.abs().max()) or 1.0
        worst = max(worst, float((p.grad - want).abs().max()) / scale)
    # The last stage's data shards' mean losses, averaged.
    loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
    dist.all_reduce(loss)
    loss_diff = abs(float(loss) / D - want_loss) / abs(want_loss)
    diffs = torch.tensor([worst, loss_diff], dtype=torch.float64)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    grad_diff, loss_diff = float(diffs[0]), float(diffs[1])
    set_dropout(chunks, a.dropout)

    for _ in range(a.warmup_steps):
        train_step()
    seconds = []
    cpu_start = time.process_time()
    for _ in range(a.steps):
        dist.barrier()
        start = time.perf_counter()
        train_step()
        seconds.append(time.perf_counter() - start)
    cpu = (time.process_time() - cpu_start) / a.steps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([peak, cpu], dtype=torch.float64))
    ok = grad_diff <= 2e-4 and loss_diff <= 2e-4
    if rank == 0:
        result = {"framework": "torch", "stages": a.stages, "data": a.data,
                  "virtual_stages": V, "processes": world, "threads_per_process": threads,
                  "torch": torch.__version__,
                  "parameters": sum(p.numel() for c in reference for p in c.parameters()),
                  "step_seconds": seconds, "tokens_per_step": B * T,
                  "peak_rss_bytes": [int(g[0]) for g in gathered],
                  "cpu_seconds_per_step": [float(g[1]) for g in gathered],
                  "check": {"ok": ok, "grad_rel_diff": grad_diff,
                            "loss_rel_diff": loss_diff, "dropout": 0.0}}
        print(f"torch {a.stages}x{a.data}: check {'PASS' if ok else 'FAIL'} (grads "
              f"{grad_diff:.1e}, loss {loss_diff:.1e}); median step "
              f"{sorted(seconds)[len(seconds) // 2] * 1e3:.1f} ms", flush=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
