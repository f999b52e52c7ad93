"""torch.distributed.pipelining on gloo, the same MLP and stage split as the JAX side.

Launched by ``run.py`` (not a test: torch is no dependency of this package)::

    torchrun --standalone --nproc-per-node 4 benchmarks/pipeline/torch_bench.py \
        --schedule 1f1b --layers 8 --width 512 --batch 512 --microbatches 8 --out r.json

Rank ``r`` holds stage ``r`` (GPipe, 1F1B) or the stages ``r, r + P, ...`` (Interleaved1F1B,
Megatron's looping placement, as torch expects). Every process runs with
``torch.set_num_threads(--threads)`` (default: the machine's cores / processes, at least 1).
Before timing, one step's loss and gradients are compared with a float64 NumPy reference of
the whole model (exit 1 when they disagree beyond float32 tolerance). Rank 0 writes the JSON:
per-step seconds of every repeat (rank 0's wall clock from a step's start to its end; stage 0
runs the step's first forward and its last backward) and the peak RSS of every rank
(``getrusage`` high-water mark) with its RSS before the first step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import (
    Shape,
    add_model_arguments,
    chunk_layers,
    make_problem,
    reference_loss_and_grads,
    relative_difference,
)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             "interleaved-1f1b": ScheduleInterleaved1F1B}


class Chunk(nn.Module):
    """Consecutive layers ``h -> tanh(h @ w + b)`` with the given float32 parameters."""

    def __init__(self, w: np.ndarray, b: np.ndarray) -> None:
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.from_numpy(a.copy())) for a in w)
        self.b = nn.ParameterList(nn.Parameter(torch.from_numpy(a.copy())) for a in b)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for w, b in zip(self.w, self.b, strict=True):
            h = torch.tanh(h @ w + b)
        return h


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.mean((out - target) ** 2)


def rss_bytes() -> int:
    """This process's resident set now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_step(name: str, shape: Shape, problem, virtual: int, rank: int, world: int,
              x: torch.Tensor, y: torch.Tensor):
    """Fresh stage modules and a schedule; ``step()`` runs one batch, returns (modules, losses)."""
    device = torch.device("cpu")
    chunks = [rank + v * world for v in range(virtual)]  # looping placement
    modules = {c: Chunk(problem.w[chunk_layers(shape, virtual, c)],
                        problem.b[chunk_layers(shape, virtual, c)]) for c in chunks}
    stages = [PipelineStage(modules[c], c, world * virtual, device) for c in chunks]
    # scale_grads (the default) divides the summed microbatch gradients by M: the gradient
    # of the mean loss, as the reference.
    if virtual > 1:
        schedule = SCHEDULES[name](stages, n_microbatches=shape.microbatches, loss_fn=mse)
    else:
        schedule = SCHEDULES[name](stages[0], n_microbatches=shape.microbatches, loss_fn=mse)
    last_chunk = world * virtual - 1

    def step() -> tuple[dict[int, Chunk], list[torch.Tensor]]:
        for m in modules.values():
            m.zero_grad(set_to_none=False)
        losses: list[torch.Tensor] = []
        args = (x,) if 0 in modules else ()
        kwargs = {"target": y, "losses": losses} if last_chunk in modules else {}
        schedule.step(*args, **kwargs)
        return modules, losses

    return step


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", required=True,
                   help="comma-separated: " + ", ".join(SCHEDULES))
    add_model_arguments(p, stages=False)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    names = a.schedule.split(",")
    if any(n not in SCHEDULES for n in names):
        p.error(f"--schedule {a.schedule}: use some of {', '.join(SCHEDULES)}")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = a.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    shape = Shape(a.layers, a.width, a.batch, world, a.microbatches, a.seed)
    problem = make_problem(shape)
    want_loss, want_gw, want_gb = reference_loss_and_grads(problem)
    x, y = torch.from_numpy(problem.x), torch.from_numpy(problem.y)
    rss_before = rss_bytes()
    steps, results = {}, {}
    for name in names:  # build and check every schedule first
        virtual = a.virtual_stages if name == "interleaved-1f1b" else 1
        shape.check(virtual)
        steps[name] = make_step(name, shape, problem, virtual, rank, world, x, y)
        modules, losses = steps[name]()
        worst = 0.0
        for c, m in modules.items():
            sl = chunk_layers(shape, virtual, c)
            for i, layer in enumerate(range(sl.start, sl.stop)):
                worst = max(worst, relative_difference(m.w[i].grad.numpy(), want_gw[layer]),
                            relative_difference(m.b[i].grad.numpy(), want_gb[layer]))
        loss_diff = 0.0
        if losses:
            got = float(torch.stack(losses).detach().mean())
            loss_diff = abs(got - want_loss) / abs(want_loss)
        diffs = torch.tensor([worst, loss_diff], dtype=torch.float64)
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        grad_diff, loss_diff = (float(v) for v in diffs)
        results[name] = {
            "framework": "torch", "schedule": name, "virtual_stages": virtual,
            "layout": f"{world} processes x 1 (torchrun, gloo)", "processes": world,
            "threads_per_process": threads, "torch": torch.__version__,
            "shape": shape.as_dict(), "step_seconds": [],
            "check": {"ok": grad_diff <= 1e-4 and loss_diff <= 1e-5,
                      "grad_rel_diff": grad_diff, "loss_rel_diff": loss_diff}}

    for name in names:
        for _ in range(a.warmup):
            steps[name]()
    # The schedules take turns, a repeat each, as on the JAX side.
    cpu = dict.fromkeys(names, 0.0)
    for _ in range(a.repeats):
        for name in names:
            dist.barrier()
            times = []
            cpu_start = time.process_time()
            for _ in range(a.steps):
                start = time.perf_counter()
                steps[name]()
                times.append(time.perf_counter() - start)
            cpu[name] += (time.process_time() - cpu_start) / a.steps / a.repeats
            results[name]["step_seconds"].append(times)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    mem = torch.tensor([peak, rss_before, *(cpu[n] for n in names)], dtype=torch.float64)
    gathered = [torch.zeros_like(mem) for _ in range(world)]
    dist.all_gather(gathered, mem)
    for i, name in enumerate(names):
        results[name]["cpu_seconds_per_step"] = [float(g[2 + i]) for g in gathered]
    if rank == 0:
        for name, result in results.items():
            result["memory"] = {
                "kind": "peak RSS per rank (getrusage ru_maxrss) of the processes that ran "
                        "all schedules of this launch",
                "peak_rss_bytes": [int(g[0]) for g in gathered],
                "rss_before_first_step_bytes": [int(g[1]) for g in gathered]}
            ok = result["check"]["ok"]
            print(f"torch {name}: check {'PASS' if ok else 'FAIL'} "
                  f"(grads {result['check']['grad_rel_diff']:.1e}, "
                  f"loss {result['check']['loss_rel_diff']:.1e}), median step "
                  f"{np.median(np.concatenate(result['step_seconds'])) * 1e3:.2f} ms",
                  flush=True)
        Path(a.out).write_text(json.dumps({"results": list(results.values())}, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(r["check"]["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
