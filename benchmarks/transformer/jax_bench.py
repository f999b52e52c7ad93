"""The transformer benchmark's JAX side: the example's training step, checked, then timed.

Launched by ``run.py``::

    python benchmarks/transformer/jax_bench.py --stages 4 --data 1 --out r.json
    mpirun -n 2 python benchmarks/transformer/jax_bench.py --stages 2 --data 2 --out r.json

Every option but ``--warmup-steps``, ``--out`` is the example's
(``python -m jax_cpu_mpi.examples.transformer``); its defaults are the example's. The
model, mesh, pipeline and step are the example's own functions: the embedding before the
pipeline, the blocks pipelined over ``--stages`` (schedule ``--schedule``, 1F1B by
default), head and loss on the last stage, gradients averaged over ``--data``, Optax's
AdamW with clipping (``make_train_step``). The devices (``stages x data``) are divided over
the MPI processes as the example does. First the example's ``--check`` (one step's loss
and gradients, dropout on, against the model on one device without a pipeline); exit 1 on
FAIL, before anything is timed. Then ``--warmup-steps`` untimed steps and ``--steps``
timed ones on batches of the example's data. Process 0 writes the JSON: every timed
step's seconds (process 0's wall clock until the step's loss is on the host; the
processes meet at a barrier before each step), every process's peak RSS
(``getrusage``), CPU seconds, and context switches and polling waits' yields and sleeps
(``jax_cpu_mpi.stats()``) per timed step.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

from jax_cpu_mpi.examples import transformer as ex

BENCH_ONLY = ("--warmup-steps", "--out")
#: Per process and timed step, in the JSON (``<name>_per_step``).
COUNTS = ("context_switches", "wait_yields", "wait_sleeps")


def split_argv(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The example's arguments, and this script's own (``--warmup-steps N --out FILE``)."""
    rest, own, i = [], {}, 0
    while i < len(argv):
        if argv[i] in BENCH_ONLY:
            own[argv[i]] = argv[i + 1]
            i += 2
        else:
            rest.append(argv[i])
            i += 1
    if "--out" not in own:
        raise SystemExit("jax_bench: --out FILE is required")
    return rest, own


def main(argv: list[str]) -> int:
    example_argv, own = split_argv(argv)
    # Before JAX starts its CPU backend: stages x data / processes devices here.
    ex._set_device_count_before_jax(example_argv)
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    args = ex.parse_args(example_argv)
    processes = ex.mpi_world_size()
    if processes is not None and processes > 1 and not jax.distributed.is_initialized():
        jax.distributed.initialize()
    is_main = jax.process_index() == 0

    def say(line: str) -> None:
        if is_main:
            print(line, flush=True)

    text = ex.load_text(args.text_chars)
    _, parts, model_tree = ex.make_model(len(text.vocab), args)
    mesh = ex.make_mesh(args)
    optimizer = ex.make_optimizer(args)
    shardings = ex.train_shardings(mesh, parts.train_tree(model_tree))
    params = jax.device_put(parts.train_tree(model_tree), shardings)
    opt_state = ex.init_opt_state(optimizer, params, mesh)
    value_and_grad = ex.make_value_and_grad(parts, mesh, args)
    M, B, T = args.microbatches, args.batch, args.seq_len
    data_spec = NamedSharding(mesh, P(None, ex.DATA))

    def microbatches(a: np.ndarray) -> jax.Array:
        a = a.reshape(M, B // M, T)
        return jax.make_array_from_callback(a.shape, data_spec, lambda index: a[index])

    base_key = jax.random.key(args.seed)
    # The check, as the example's --check.
    ids, targets = ex.batch_at(text.train, args.seed, 0, B, T)
    key = jax.random.fold_in(base_key, 0)
    loss, grads = jax.jit(value_and_grad)(params, microbatches(ids), microbatches(targets),
                                          key)
    lines: list[str] = []
    ok = ex.run_check(parts, args, model_tree, ids.reshape(M, B // M, T),
                      targets.reshape(M, B // M, T), key, float(ex.host(loss)),
                      parts.model_tree(ex.host(grads)), lines.append)
    for line in lines:
        say(line)
    worst = float(lines[-1].split()[-1].rstrip(")"))
    if not ok:
        return 1

    train_step = ex.make_train_step(
        ex.make_value_and_grad(parts, mesh, args, with_norm=True), optimizer,
        (shardings, jax.tree.map(lambda a: a.sharding, opt_state), NamedSharding(mesh, P())),
        args.seed)
    steps = int(own.get("--warmup-steps", "2")) + args.steps
    # The batches on the devices before the clock starts, as the torch side's.
    batches = [tuple(map(microbatches, ex.batch_at(text.train, args.seed, i, B, T)))
               for i in range(steps)]
    from jax.experimental import multihost_utils

    import jax_cpu_mpi

    def counts() -> np.ndarray:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        stats = jax_cpu_mpi.stats()
        return np.asarray([usage.ru_nvcsw + usage.ru_nivcsw, stats["wait_yields"],
                           stats["wait_sleeps"]], np.float64)

    seconds = []
    cpu_start = 0.0
    counts_start = counts()
    for i, (x, y) in enumerate(batches):
        if i == steps - args.steps:
            cpu_start = time.process_time()
            counts_start = counts()
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("step")
        start = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, x, y, i)
        float(ex.host(loss))
        if i >= steps - args.steps:
            seconds.append(time.perf_counter() - start)
    cpu = (time.process_time() - cpu_start) / max(1, args.steps)
    per_step = (counts() - counts_start) / max(1, args.steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    mine = np.asarray([peak, cpu, *per_step], np.float64)
    every = (multihost_utils.process_allgather(mine) if jax.process_count() > 1
             else mine[None])
    if is_main:
        result = {"framework": "jax", "stages": args.stages, "data": args.data,
                  "schedule": args.schedule, "virtual_stages": args.virtual_stages,
                  "processes": jax.process_count(), "process_axis": args.process_axis,
                  "devices_per_process": jax.local_device_count(),
                  "jax": jax.__version__, "remat": args.remat,
                  "xla_flags": os.environ.get("XLA_FLAGS", ""),
                  "parameters": int(sum(np.size(a) for a in jax.tree.leaves(model_tree))),
                  "step_seconds": seconds, "tokens_per_step": B * T,
                  "peak_rss_bytes": [int(r[0]) for r in every],
                  "cpu_seconds_per_step": [float(r[1]) for r in every],
                  # What the load changes least: the context switches and the polling
                  # waits' yields and sleeps (jax_cpu_mpi.stats()) of each process.
                  **{f"{name}_per_step": [float(r[2 + k]) for r in every]
                     for k, name in enumerate(COUNTS)},
                  "check": {"ok": ok, "grad_rel_diff": worst, "dropout": args.dropout}}
        print(f"jax {args.stages}x{args.data}: check PASS ({worst:.1e}); median step "
              f"{sorted(seconds)[len(seconds) // 2] * 1e3:.1f} ms", flush=True)
        Path(own["--out"]).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
