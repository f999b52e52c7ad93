"""The transformer example (``python -m jax_cpu_mpi.examples.transformer``): its check, its
checkpoints, and the same job under mpirun.

Tiny models (2 blocks of width 16, 16 characters) keep each run to a compilation or two:
``--check`` in this process (4 of pytest's devices), a check that can fail, one
``mpirun -n 2`` x 2 devices run (training, an Orbax checkpoint written by both ranks), and
a run killed after its first checkpoint and started again, which must end with the
parameters of a run that went through.
"""

from __future__ import annotations

import os
import subprocess
from functools import partial

import numpy as np
import pytest
from jax_p2p_removal import python_prefix

from jax_cpu_mpi._src.runtime import config
from mpi_launcher import CHEAP_COMPILE_FLAGS, llvm_unoptimized, run_mpi

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

MODULE = "jax_cpu_mpi.examples.transformer"
TINY = ["--layers", "4", "--width", "16", "--heads", "2", "--seq-len", "16", "--batch", "8",
        "--microbatches", "2", "--text-chars", "40000", "--eval-every", "2",
        "--eval-batches", "1"]


#: XLA's flags for the example's runs in subprocesses (mpi_launcher.CHEAP_COMPILE_FLAGS): the
#: backend (LLVM) optimization level 0, and (jaxlib 0.10) XLA CPU's older fusion emitters (LLVM
#: IR written directly) instead of its MLIR ones, whose lowering of the fusions through MLIR's
#: passes is most of what is left of the compilation, which is most of these runs. What they
#: check (a launch across processes trains and checkpoints; a resumed run ends bit for bit
#: where one that went through did, all built alike) depends on neither. The in-process
#: --check runs with the flags of pytest's process (conftest.py).
LLVM_UNOPTIMIZED = CHEAP_COMPILE_FLAGS


# Every schedule's keyed gradients are compared with the reference in
# tests/pipeline/test_pipeline_keys.py (and under mpirun in tests/pipeline/test_pipeline_mpi.py);
# here the example's own check runs once, for ZB-H1 with a data axis, kept residuals and W
# split off: each check compiles the one-device reference (unrolled over microbatches,
# shards and blocks), and the suite's time is limited. 2 blocks, one per stage, keep it quick.
CHECKS = [("zero-bubble", 2, 2, "--no-remat")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule,layers,data,remat", CHECKS, ids=[c[0] for c in CHECKS])
def test_check_passes(schedule, layers, data, remat, capsys):
    from jax_cpu_mpi.examples import transformer

    args = [*TINY, "--stages", "2", "--data", str(data), "--schedule", schedule, "--steps",
            "0", "--check", "--dropout", "0.2", "--layers", str(layers)]
    # The kept residuals' slots poisoned (NaN): a read before a write fails the check.
    with config.overrides(poison_uninitialized=True):
        assert transformer.main(args + ([remat] if remat else [])) == 0
    out = capsys.readouterr().out
    assert "check: PASS" in out, out
    # Every block's gradients were compared.
    assert all(f"block {b} gradients" in out for b in range(layers)), out


def test_the_check_tells_pass_from_fail(capsys):
    """run_check fails gradients off by 1e-3 in one block, and a loss off as much."""
    import jax

    from jax_cpu_mpi.examples import transformer

    args = transformer.parse_args([*TINY, "--stages", "2", "--data", "1", "--layers", "2"])
    text = transformer.load_text(args.text_chars)
    _, parts, tree = transformer.make_model(len(text.vocab), args)
    ids, targets = transformer.batch_at(text.train, 0, 0, args.batch, args.seq_len)
    ids, targets = ids.reshape(2, 4, -1), targets.reshape(2, 4, -1)
    key = jax.random.key(0)
    loss, grads = transformer.reference_value_and_grad(parts, args)(tree, ids, targets, key)
    grads = transformer.host(grads)

    def check(loss, grads, want=(float(loss), grads)):
        return transformer.run_check(parts, args, tree, ids, targets, key, loss, grads, print,
                                     want=want)

    # The reference against itself: PASS. (Given, not computed again by run_check: a second
    # compilation of the reference. run_check's own reference, want=None, is what
    # test_check_passes checks, through the example's --check.)
    assert check(float(loss), grads)
    off = jax.tree.map(np.copy, grads)
    off["blocks"][1]["up"]["kernel"] *= 1 + 1e-3
    assert not check(float(loss), off)
    assert not check(float(loss) * (1 + 1e-3), grads)
    verdicts = [line.split()[1] for line in capsys.readouterr().out.splitlines()
                if line.startswith("check: ") and line.split()[1] in ("PASS", "FAIL")]
    assert verdicts == ["PASS", "FAIL", "FAIL"]


@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clipped", "kept"])
def test_the_clip_is_optaxs_given_the_norm_or_not(max_norm):
    """The example's clipping, given the norm (as its step does) or computing it, gives
    optax.clip_by_global_norm's updates and state (so checkpoints restore either way)."""
    import jax
    import optax

    from jax_cpu_mpi.examples import transformer

    rng = np.random.default_rng(0)
    tree = {"embed": {"e": rng.normal(size=(5, 3))}, "head": {"h": rng.normal(size=(3,))},
            "blocks": {"k": rng.normal(size=(2, 4, 3)), "b": rng.normal(size=(2, 3))}}
    tree = jax.tree.map(lambda a: np.asarray(a, np.float32), tree)
    ours, want = transformer.clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
    assert ours.init(tree) == want.init(tree)
    wanted = want.update(tree, None)[0]
    norm = np.sqrt(sum(np.sum(np.square(a)) for a in jax.tree.leaves(tree)))
    for got in (ours.update(tree, ours.init(tree), global_norm=norm)[0],
                ours.update(tree, ours.init(tree))[0]):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(wanted), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)



def test_the_blocks_ops_are_flaxs_and_jaxs():
    """The example's own forms of its ops give what they replace: ``Linear`` (its kernel
    gradient from a transposed copy, or contracted in place) ``nnx.Linear``'s values and
    gradients, and
    ``causal_attention`` ``jax.nn.dot_product_attention(is_causal=True)``'s. The pipeline's
    check cannot see a wrong gradient here: its reference runs the same ops."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_cpu_mpi.examples import transformer

    # Both forms of the kernel gradient: from the transposed copy (input narrower than
    # the output) and contracted in place (wider).
    for features_in, features_out in [(16, 24), (24, 16)]:
        ours = transformer.Linear(features_in, features_out, rngs=nnx.Rngs(0))
        flax_linear = nnx.Linear(features_in, features_out, rngs=nnx.Rngs(0))
        graph, params = nnx.split(ours)
        flax_graph, _ = nnx.split(flax_linear)
        x = jax.random.normal(jax.random.key(1), (3, 5, features_in))
        dy = jax.random.normal(jax.random.key(2), (3, 5, features_out))

        # Jitted, as the example runs them: one compilation each instead of one per op.
        @partial(jax.jit, static_argnums=0)
        def grads(graph, params, x, dy):
            y, vjp = jax.vjp(lambda p, x: nnx.merge(graph, p)(x), params, x)
            return y, vjp(dy)

        for g, w in zip(jax.tree.leaves(grads(graph, params, x, dy)),
                        jax.tree.leaves(grads(flax_graph, params, x, dy)),
                        strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)

    q, k, v, dout = (jax.random.normal(jax.random.key(i), (2, 8, 2, 4)) for i in range(4))

    @partial(jax.jit, static_argnums=0)
    def value_and_grads(f, q, k, v, dout):
        out, vjp = jax.vjp(f, q, k, v)
        return [out, *vjp(dout)]

    got = value_and_grads(transformer.causal_attention, q, k, v, dout)
    want = value_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                           q, k, v, dout)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    # Causal: an output does not depend on later positions.
    later = k.at[:, 4:].set(jnp.zeros_like(k[:, 4:]))
    np.testing.assert_array_equal(np.asarray(transformer.causal_attention(q, later, v)[:, :4]),
                                  np.asarray(transformer.causal_attention(q, k, v)[:, :4]))

def test_the_dropout_keeps_its_rate_scale_and_keys():
    """The example's ``Dropout`` (two elements' 16 bits from each random word): it keeps
    ``1 - rate`` of the elements, scaled so the mean is kept, the same mask for the same
    key and another for another key, an odd width too, and nothing without a key."""
    import jax.numpy as jnp
    from flax import nnx

    from jax_cpu_mpi.examples import transformer

    drop = transformer.Dropout(0.25)
    assert isinstance(drop, nnx.Dropout)
    x = jnp.ones((64, 32, 129), jnp.float32)
    y = np.asarray(drop(x, rngs=nnx.Rngs(dropout=0)))
    kept = y != 0
    # 264,192 elements: the kept fraction's standard deviation is about 8.4e-4.
    assert abs(kept.mean() - 0.75) < 5e-3, kept.mean()
    np.testing.assert_allclose(y[kept], 65536 / round(0.75 * 65536), rtol=1e-6)
    assert abs(y.mean() - 1.0) < 1e-2
    # Both halves of the words, and the odd last element, are used.
    for part in (kept[..., :65], kept[..., 65:], kept[..., -1]):
        assert abs(part.mean() - 0.75) < 2e-2
    assert np.array_equal(np.asarray(drop(x, rngs=nnx.Rngs(dropout=0))), y)
    other = np.asarray(drop(x, rngs=nnx.Rngs(dropout=1))) != 0
    assert 0.3 < (other != kept).mean() < 0.45  # 2 x 0.75 x 0.25 of them differ
    # The two halves of a word are not the same draw.
    assert (kept[..., :64] != kept[..., 65:129]).mean() > 0.3
    assert drop(x, deterministic=True) is x
    with pytest.raises(ValueError, match="no rngs"):
        drop(x)


@pytest.mark.parametrize("axis", ["data", "stage"])
def test_the_process_axis_places_a_process_on_one_shard_or_one_stage(axis, monkeypatch):
    from types import SimpleNamespace

    import jax

    from jax_cpu_mpi.examples import transformer

    # Two processes of 2 devices each, as mpirun -n 2 gives them (device ids 0-3).
    fake = [SimpleNamespace(process_index=i // 2, id=i) for i in (3, 1, 0, 2)]
    monkeypatch.setattr(jax, "devices", lambda: fake)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax.sharding, "Mesh", lambda grid, names: (grid, names))
    args = transformer.parse_args(["--stages", "2", "--data", "2", "--process-axis", axis])
    grid, names = transformer.make_mesh(args)
    assert names == (transformer.STAGE, transformer.DATA)
    process = np.vectorize(lambda d: d.process_index)(grid)
    # data: each data shard (a column) in one process, its stages in the process's order;
    # stage: each stage (a row) in one process.
    expected = [[0, 1], [0, 1]] if axis == "data" else [[0, 0], [1, 1]]
    assert process.tolist() == expected
    assert sorted(d.id for d in grid.ravel()) == [0, 1, 2, 3]


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_mpirun_n2x2devices_trains_and_checkpoints(tmp_path):
    run = run_mpi(MODULE, *TINY, "--stages", "2", "--data", "2", "--schedule",
                  "interleaved-1f1b", "--layers", "4", "--steps", "2",
                  "--checkpoint", str(tmp_path), "--checkpoint-every", "2",
                  nprocs=2, module=True, timeout=560,
                  env=llvm_unoptimized())
    assert run.returncode == 0, run.report()
    out = "\n".join(run.by_rank()[0])
    assert ("2 stages x 2 data shards on 2 process(es) x 2 CPU device(s), the data axis "
            "across them") in out, out
    assert "step     2/2" in out and "val " in out, out
    assert f"checkpoint: step 2 saved in {tmp_path}" in out, out
    assert (tmp_path / "2").is_dir()
    assert not any("step " in line for line in run.by_rank()[1]), run.report()


def _run(args: list[str], kill_after: str | None = None, cache=None) -> str:
    """The example in a subprocess (2 devices); killed (SIGKILL) once it prints a line
    starting with ``kill_after``. With ``cache`` (a directory), JAX's persistent compilation
    cache: runs of the same model then compile it once."""
    env = dict(os.environ, JAX_CPU_MPI_RECV_TIMEOUT="60")
    if cache is not None:
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    env["XLA_FLAGS"] = LLVM_UNOPTIMIZED  # the example adds its own device count
    proc = subprocess.Popen([*python_prefix(), "-u", "-m", MODULE, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if kill_after and line.startswith(kill_after):
                proc.kill()
                break
        proc.wait(timeout=280)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert proc.returncode == (-9 if kill_after else 0), out
    return out


def _saved(directory, step: int) -> dict:
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer().restore((directory / str(step) / "state").absolute())


@pytest.mark.timeout(900)
def test_a_killed_run_resumes_to_the_same_parameters(tmp_path):
    """Checkpoints every 2 steps of 4; one run goes through, the other is killed once its
    step-2 checkpoint is saved and started again: both save the same step 4 (parameters,
    optimizer state), though the second did only steps 3 and 4 after its restart."""
    args = [*TINY, "--stages", "2", "--data", "1", "--steps", "4", "--checkpoint-every", "2",
            "--dropout", "0.1", "--layers", "2", "--eval-every", "0"]
    through, killed = tmp_path / "through", tmp_path / "killed"
    # The three runs compile the same programs: the first one's compilations serve the
    # others (what is checked is the checkpoints, not the compiler).
    cache = tmp_path / "jax-cache"
    _run([*args, "--checkpoint", str(through)], cache=cache)
    _run([*args, "--checkpoint", str(killed)], kill_after="checkpoint: step 2 saved",
         cache=cache)
    assert not (killed / "4").exists()
    out = _run([*args, "--checkpoint", str(killed)], cache=cache)
    assert "checkpoint: resumed from step 2" in out, out
    assert "step     3/4" in out and "step     2/4" not in out, out
    want, got = _saved(through, 4), _saved(killed, 4)
    assert int(got["step"]) == 4
    import jax

    leaves = jax.tree_util.tree_leaves_with_path(want)
    assert jax.tree.structure(got) == jax.tree.structure(want) and len(leaves) > 20
    for (path, a), b in zip(leaves, jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=str(path))
    # Training moved the parameters from step 2's.
    before = _saved(killed, 2)["params"]["head"]["out"]["kernel"]
    assert not np.array_equal(before, got["params"]["head"]["out"]["kernel"])
