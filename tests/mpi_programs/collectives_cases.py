"""psum/pmean/pmax/pmin between processes over MPI against gloo (JAX's path) and NumPy.

Run by tests/runtime/test_collectives_mpi.py under ``mpirun -n 2`` with 1 or 2 devices per
process. Every case is computed twice in this program, with ``collectives="mpi"`` and with
``collectives="gloo"`` (each lowered afresh), and against a NumPy reference. Many cases share
one jitted program (one dict of operands), so the matrix costs few compilations. Prints one
line per case, then JCM-OK.
"""

import functools
import glob
import json
import os
import re
import tempfile

import _mpi_common as common
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_cpu_mpi
from jax_cpu_mpi import _jax_cpu_mpi, config
from jax_cpu_mpi._src.ffi.custom_calls import ORDER_TOKEN_TARGET
from jax_cpu_mpi._src.lowering import collectives as lowering

jax.config.update("jax_enable_x64", True)
n = jax.device_count()
mesh = jax.make_mesh((n,), ("x",))
failures: list[str] = []


#: With 2 devices per process, the ways a device that does not lead its process's meeting
#: waits, in turn (tests/runtime/test_collectives_mpi.py runs the matrix both ways in one
#: launch, on any machine: JCM_TEST_PARK_MODES=on,off): "on" parks (its call returns a
#: pending future) in every program that allows it, "off" waits in the meeting. The mode is
#: read when a program runs (set_meeting_handoff), not when it is compiled: each program is
#: compiled once and run in each mode (each_mode). Otherwise JAX_CPU_MPI_PARK's mode alone.
MODES = os.environ.get("JCM_TEST_PARK_MODES",
                       os.environ.get("JAX_CPU_MPI_PARK", "off")).split(",")
_HANDOFF = {"off": 0, "auto": 1, "on": 2}
#: Calls that parked in each mode so far (each_mode).
PARKED = dict.fromkeys(MODES, 0)


def meeting(mode: str) -> None:
    """Set how a non-leading device waits for the programs that follow (2 devices)."""
    if jax.local_device_count() > 1:
        _jax_cpu_mpi.set_meeting_handoff(_HANDOFF[mode])


def parks() -> int:
    """Collective calls of this process that parked so far."""
    return int(jax_cpu_mpi.stats()["collective_parks"])


#: The results' gather: process_allgather (common.gather) compiles a gloo program for each
#: shape and dtype of result, a large part of this launch's compilations.
gather = common.gather_over_mpi


def _same_bits(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(
            np.atleast_1d(np.asarray(x)).view(np.uint8),
            np.atleast_1d(np.asarray(y)).view(np.uint8)) for x, y in zip(la, lb, strict=True))


def each_mode(name: str, call):
    """``call()`` (which gathers or blocks on what it returns) in each of MODES, the first
    mode's result returned, the mode left at the first. A later mode's result must equal it
    bit for bit, so it passes every check the first one passes (2 devices per process reduce
    in the same order either way: the meeting's leader reduces the operands by position);
    where not, the failure names the program and the mode."""
    results = []
    for mode in MODES:
        meeting(mode)
        before = parks()
        results.append(jax.block_until_ready(call()))
        PARKED[mode] += parks() - before
    meeting(MODES[0])
    for mode, got in zip(MODES[1:], results[1:], strict=True):
        if not _same_bits(got, results[0]):
            failures.append(f"{name} (park {mode})")
            print(f"FAIL {name} (park {mode}): differs from park {MODES[0]}'s result",
                  flush=True)
    return results[0]


def run_in(setting: str, name: str, call):
    """``call()``: in each park mode where ``setting`` lowers the collectives over MPI."""
    return each_mode(name, call) if setting == "mpi" else call()


OPS = {"psum": jax.lax.psum, "pmax": jax.lax.pmax, "pmin": jax.lax.pmin,
       "pmean": jax.lax.pmean}
NUMPY = {"psum": lambda a: a.sum(0, dtype=a.dtype), "pmax": lambda a: a.max(0),
         "pmin": lambda a: a.min(0), "pmean": lambda a: a.mean(0, dtype=a.dtype)}
INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOATS = ["float32", "float64"]


def values(dtype: str, shape: tuple, seed: int) -> np.ndarray:
    """One operand per device (leading axis n), deterministic, full range for integers (so
    sums wrap), with a NaN in float cases named so."""
    rng = np.random.default_rng(seed)
    full = (n, *shape)
    if dtype == "bool":
        return rng.integers(0, 2, full).astype(bool)
    if dtype in INTS:
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, full, dtype=dtype, endpoint=True)
    if dtype.startswith("complex"):
        return (rng.standard_normal(full) + 1j * rng.standard_normal(full)).astype(dtype)
    return rng.standard_normal(full).astype(ml_dtypes.finfo(dtype).dtype)


def _as_bytes(o):
    if o.dtype == jnp.bool_:
        return o.astype(jnp.uint8).reshape(-1)
    if jnp.issubdtype(o.dtype, jnp.complexfloating):
        o = jnp.stack([o.real, o.imag], axis=-1)
    return jax.lax.bitcast_convert_type(o, jnp.uint8).reshape(-1)


def run_packed(setting: str, m, operands: dict, fn_of_key) -> dict:
    """Every operand through its collective in ONE program over the 1-D mesh ``m``, lowered
    with ``setting``; the results go back as one byte array per device (one gather: a
    gather per result would cost a compilation each)."""
    config.configure(collectives=setting)
    axis = m.axis_names[0]
    layout = {}

    def body(tree):
        outs = {k: fn_of_key(k)(v[0]) for k, v in sorted(tree.items())}
        for k, o in outs.items():
            layout[k] = (o.shape, np.dtype(o.dtype))
        return jnp.concatenate([_as_bytes(o) for o in outs.values()])[None]

    f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P(axis), out_specs=P(axis)))
    arrays = {k: common.global_array(m, P(axis), v) for k, v in operands.items()}
    if setting == "mpi":
        first = min(operands)
        flat = each_mode(f"the program of {first} and {len(operands) - 1} more",
                         lambda: gather(f(arrays)))
    else:
        flat = gather(f(arrays))
    out, at = {}, 0
    for k, (shape, dtype) in layout.items():
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        out[k] = np.ascontiguousarray(flat[:, at:at + size]).view(dtype).reshape(
            (flat.shape[0], *shape))
        at += size
    return out


_REDUCTION = {"psum": "sum", "pmean": "sum", "pmax": "max", "pmin": "min",
              "psum_scatter": "sum"}


def by_path(cases: dict, op_of, dtype_of) -> list[dict]:
    """``cases`` in two programs: those whose collectives all go over MPI, and those some of
    which keep JAX's lowering (MPI has no such reduction). A collective of XLA's own keeps
    the devices of its whole program from parking (passes/park_safety.py): apart, the first
    program parks where the launch parks."""
    over_mpi: dict = {}
    rest: dict = {}
    for key, case in cases.items():
        red = _REDUCTION.get(op_of(key))
        mpi_can = red is None or dtype_of(key) in lowering.MPI_DTYPES[red]
        (over_mpi if mpi_can else rest)[key] = case
    return [part for part in (over_mpi, rest) if part]


def run_all(setting: str, operands: dict, fn_of_key) -> dict:
    """Every operand through its collective in ONE program, lowered with ``setting``."""
    return run_packed(setting, mesh, operands, fn_of_key)


def check(name: str, got: np.ndarray, want: np.ndarray, exact: bool) -> None:
    try:
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        # Every device holds the same bits.
        for i in range(1, got.shape[0]):
            np.testing.assert_array_equal(np.atleast_1d(got[i]).view(np.uint8),
                                          np.atleast_1d(got[0]).view(np.uint8))
        if exact:
            np.testing.assert_array_equal(got[0], want)
        else:
            tol = 1e-2 if want.dtype.itemsize <= 2 else 1e-5
            np.testing.assert_allclose(got[0].astype(np.float64 if want.dtype.kind == "f"
                                                     else want.dtype),
                                       want.astype(np.float64 if want.dtype.kind == "f"
                                                   else want.dtype),
                                       rtol=tol, atol=tol, equal_nan=True)
        print(f"ok   {name}", flush=True)
    except AssertionError as e:
        failures.append(name)
        print(f"FAIL {name}: {e}", flush=True)


# ---- the dtype x reduction x shape matrix, in one program per setting
operands, keys = {}, {}
shapes = [(), (3, 5), (1 << 18,)]  # 0-d, small, 1-2 MiB (MPI's large-message algorithms)
seed = 0
for op in OPS:
    dtypes = [*FLOATS, "float16", "bfloat16"]
    if op != "pmean":
        dtypes += INTS
    if op == "psum":
        dtypes += ["complex64", "complex128"]
    if op in ("pmax", "pmin"):
        dtypes += ["bool"]
    for dtype in dtypes:
        for shape in shapes:
            if shape == (1 << 18,) and dtype not in ("float32", "int32", "float64"):
                continue
            seed += 1
            key = f"{op}/{dtype}/{shape}"
            operands[key] = values(dtype, shape, seed)
            keys[key] = op
for op in ("pmax", "pmin"):  # NaN propagates, as XLA's maximum/minimum
    v = values("float32", (4,), 99)
    v[n - 1, 1] = np.nan
    operands[f"{op}/float32-nan/(4,)"] = v
    keys[f"{op}/float32-nan/(4,)"] = op
# Large, with an element count that the 2 processes do not divide evenly (MPI's large-message
# all-reduce cuts it in chunks, one per process).
for op, dtype in (("psum", "int32"), ("pmax", "float32")):
    operands[f"{op}/{dtype}/(65537,)"] = values(dtype, (65537,), 98)
    keys[f"{op}/{dtype}/(65537,)"] = op


def fn_of(key):
    return functools.partial(OPS[keys[key]], axis_name="x")


mpi = {}
for part in by_path(operands, keys.get, lambda k: operands[k].dtype.name):
    mpi.update(run_all("mpi", part, fn_of))
gloo = run_all("gloo", operands, fn_of)
for key, v in operands.items():
    op, dtype, _ = key.split("/")
    exact = v.dtype.kind in "iub"
    want = NUMPY[op](v.astype(np.float64) if v.dtype.itemsize <= 2 and v.dtype.kind == "f"
                     else v)
    if v.dtype.kind == "f" and v.dtype.itemsize <= 2:
        want = want.astype(v.dtype)
    check(f"mpi  {key} vs numpy", mpi[key], want, exact)
    if "nan" not in dtype:  # gloo's max/min need not propagate NaN
        check(f"mpi  {key} vs gloo", mpi[key], gloo[key][0], exact or n <= 2)

# ---- all_gather, psum_scatter, all_to_all: dtypes x shapes x dimensions, one program per
# setting. Data movement (all_gather, all_to_all) is bit for bit against gloo for every dtype.


def split(a: np.ndarray, axis: int) -> list:
    return np.split(a, n, axis=axis)


EXCHANGES: dict[str, tuple] = {}  # key -> (operand, function of the shard, NumPy per device)


def exchange_case(key, v, fn, ref):
    EXCHANGES[key] = (v, fn, ref)


for dtype in ["int8", "float32", "bfloat16", "bool", "complex64"]:
    for shape, axis, tiled in [((), 0, False), ((3, 5), 1, False), ((3, 5), 1, True)]:
        if shape == () and dtype != "int8":
            continue
        seed += 1
        exchange_case(f"all_gather/{dtype}/{shape}/axis={axis}/tiled={tiled}",
                      values(dtype, shape, seed),
                      functools.partial(jax.lax.all_gather, axis=axis, tiled=tiled),
                      lambda v, i, axis=axis, tiled=tiled:
                          (np.concatenate if tiled else np.stack)(list(v), axis=axis))
    for shape, s_ax, c_ax in [((n * 2, 3), 0, 1), ((2, n, 3), 1, 2)]:
        seed += 1
        exchange_case(f"all_to_all/{dtype}/{shape}/split={s_ax}/concat={c_ax}",
                      values(dtype, shape, seed),
                      functools.partial(jax.lax.all_to_all, split_axis=s_ax,
                                        concat_axis=c_ax, tiled=True),
                      lambda v, i, s_ax=s_ax, c_ax=c_ax: np.concatenate(
                          [split(v[j], s_ax)[i] for j in range(n)], axis=c_ax))
for dtype in ["int8", "uint64", "float32", "float16"]:
    for shape, d, tiled in [((n * 3, 5), 0, True), ((4, n * 2), 1, True), ((2, n), 1, False)]:
        if dtype == "float16" and d == 1:  # on gloo (no MPI reduction of it): one case
            continue
        seed += 1
        exchange_case(f"psum_scatter/{dtype}/{shape}/dim={d}/tiled={tiled}",
                      values(dtype, shape, seed),
                      functools.partial(jax.lax.psum_scatter, scatter_dimension=d,
                                        tiled=tiled),
                      lambda v, i, d=d, tiled=tiled: (
                          split(NUMPY["psum"](v.astype(np.float64) if v.dtype.itemsize <= 2
                                              and v.dtype.kind == "f" else v), d)[i]
                          if tiled else np.take(NUMPY["psum"](v), i, axis=d)
                      ).astype(v.dtype))
# >= 256 KiB per device: MPI's large-message algorithms
seed += 1
exchange_case("all_gather/float32/(65536,)/axis=0/tiled=True", values("float32", (1 << 16,), seed),
              functools.partial(jax.lax.all_gather, axis=0, tiled=True),
              lambda v, i: np.concatenate(list(v)))
exchange_case("psum_scatter/int32/big/dim=0/tiled=True", values("int32", (n << 16,), seed),
              functools.partial(jax.lax.psum_scatter, scatter_dimension=0, tiled=True),
              lambda v, i: split(v.sum(0, dtype=v.dtype), 0)[i])
exchange_case("psum_scatter/float32/big/dim=0/tiled=True", values("float32", (n << 15,), seed),
              functools.partial(jax.lax.psum_scatter, scatter_dimension=0, tiled=True),
              lambda v, i: split(v.astype(np.float64).sum(0).astype(np.float32), 0)[i])
# An output of 4 MiB and more (n devices x 2 MiB) asks for huge pages before MPI writes it
# (kHugePageHintBytes): NumPy checks it, on the device-order mesh.
exchange_case("all_gather/int32/huge/axis=0/tiled=True", values("int32", (1 << 19,), seed),
              functools.partial(jax.lax.all_gather, axis=0, tiled=True),
              lambda v, i: np.concatenate(list(v)))
# A block of a whole copy piece and a tail: with several devices per process, the leader
# copies its process's blocks into every local output 256 KiB at a time (LeadExchange).
exchange_case("all_gather/int8/(262147,)/axis=0/tiled=True", values("int8", ((1 << 18) + 3,), seed),
              functools.partial(jax.lax.all_gather, axis=0, tiled=True),
              lambda v, i: np.concatenate(list(v)))
exchange_case("all_to_all/float64/big/split=0/concat=1", values("float64", (n << 14, 4), seed),
              functools.partial(jax.lax.all_to_all, split_axis=0, concat_axis=1, tiled=True),
              lambda v, i: np.concatenate([split(v[j], 0)[i] for j in range(n)], axis=1))


# all_to_all of the leading axis goes in place (MPI_IN_PLACE) where XLA lets the result take
# the operand's buffer: small (a persistent request) and large, and once with the operand
# read after the call (XLA must keep it: the result may not overwrite it).
def _a2a0(v, axis_name):
    return jax.lax.all_to_all(v, axis_name, 0, 0, tiled=True)


def _a2a0_ref(v, i):
    return np.concatenate([split(v[j], 0)[i] for j in range(n)], axis=0)


def _a2a0_reread(v, axis_name):
    return _a2a0(v, axis_name) ^ v


exchange_case("all_to_all/int32/(n*4,)/split=0/concat=0", values("int32", (n * 4,), seed),
              _a2a0, _a2a0_ref)
exchange_case("all_to_all/int32/big/split=0/concat=0", values("int32", (n << 16,), seed),
              _a2a0, _a2a0_ref)
exchange_case("all_to_all/int8/(n*8,)/split=0/concat=0/reread", values("int8", (n * 8,), seed),
              _a2a0_reread, lambda v, i: _a2a0_ref(v, i) ^ v[i])


def run_exchanges(setting: str, m, cases: dict) -> dict:
    axis = m.axis_names[0]
    return run_packed(setting, m, {k: e[0] for k, e in cases.items()},
                      lambda k: functools.partial(cases[k][1], axis_name=axis))


# The mesh in device order, and (2 devices per process) with the processes interleaved:
# group positions that are not process after process go through the staging buffers.
meshes = {"": mesh}
if n == 4:
    devs = np.array(jax.devices())
    order = sorted(range(n), key=lambda i: (i % 2, i))  # positions 0, 2 / 1, 3 per process
    meshes[" interleaved"] = jax.sharding.Mesh(devs[np.argsort(order)], ("x",))
parked_by_mesh: dict[str, dict[str, int]] = {mode: {} for mode in MODES}
for label, m in meshes.items():
    parked_before = dict(PARKED)
    # NumPy checks every case; gloo (a compilation of its own, slow) the float32 and large
    # ones; the interleaved mesh runs the int8 and large ones.
    cases = EXCHANGES if not label else {
        k: e for k, e in EXCHANGES.items() if "/int8/" in k or "big" in k or "65536" in k}
    ex_mpi = {}
    for part in by_path(cases, lambda k: k.split("/")[0],
                        lambda k, c=cases: c[k][0].dtype.name):
        ex_mpi.update(run_exchanges("mpi", m, part))
    ex_gloo = {} if label else run_exchanges("gloo", m, {
        k: e for k, e in cases.items() if "/float32/" in k or "big" in k or "65536" in k})
    for key, (v, _, ref) in cases.items():
        op, dtype = key.split("/")[:2]
        reduces = op == "psum_scatter"
        exact = not reduces or v.dtype.kind in "iub"
        name = f"{key}{label}"
        try:
            for i in range(n):
                want = np.asarray(ref(v, i))
                got = ex_mpi[key][i]
                assert got.dtype == v.dtype and got.shape == want.shape, (got.shape, want.shape)
                if exact:
                    np.testing.assert_array_equal(np.atleast_1d(got).view(np.uint8),
                                                  np.atleast_1d(want).view(np.uint8))
                else:
                    tol = 1e-2 if v.dtype.itemsize <= 2 else 1e-5
                    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                               rtol=tol, atol=tol)
            gloo_exact = key in ex_gloo and exact and all(
                np.array_equal(ex_gloo[key][i], np.asarray(ref(v, i))) for i in range(n))
            if key in ex_gloo and exact and not gloo_exact:
                # Ours equals NumPy (checked above); JAX's gloo reduce-scatter of this int32
                # case now and then returns a wrong tail on device 0 (the last 260 bytes, the
                # same wrong bytes every time), also in launches whose exchanges all run on
                # gloo: the reference is wrong there, not the result under test.
                print(f"note {name}: gloo's own result differs from NumPy (JAX's gloo "
                      "path); compared with NumPy only", flush=True)
            elif key in ex_gloo and exact:
                np.testing.assert_array_equal(ex_mpi[key], ex_gloo[key])
            elif key in ex_gloo:
                np.testing.assert_allclose(ex_mpi[key].astype(np.float64),
                                           ex_gloo[key].astype(np.float64), rtol=1e-5,
                                           atol=1e-5)
            against = "numpy and gloo" if key in ex_gloo else "numpy"
            print(f"ok   mpi  {name} vs {against}", flush=True)
        except AssertionError as e:
            failures.append(name)
            print(f"FAIL {name}: {e}", flush=True)
    for mode in MODES:
        parked_by_mesh[mode][label or " in device order"] = PARKED[mode] - parked_before[mode]

# The matrix took the path this launch asked for, on each mesh (the interleaved one's
# meetings stage their operands for MPI: parked devices must find their results there
# too): parked calls on, none off.
for mode in MODES if jax.local_device_count() == 2 else ():
    if mode not in ("on", "off"):
        continue
    try:
        assert all((c > 0) == (mode == "on") for c in parked_by_mesh[mode].values()), (
            mode, parked_by_mesh[mode])
        print(f"ok   mpi  the matrix's devices {'parked' if mode == 'on' else 'waited'} "
              f"(park {mode}: parked calls by mesh: {parked_by_mesh[mode]})", flush=True)
    except AssertionError as e:
        failures.append(f"parked path (park {mode})")
        print(f"FAIL parked path (park {mode}): {e}", flush=True)

# ---- the lowerings that did not go over MPI say why
decided = lowering.decisions()
over_mpi = {(p, d) for (p, d, how) in decided if how == "mpi"}
print("lowered over MPI:", sorted(over_mpi), flush=True)
for p, d in [("psum_invariant", "float16"), ("psum_invariant", "bfloat16")]:
    if (p, d) in over_mpi:
        failures.append(f"{p}/{d} went over MPI")
        print(f"FAIL {p}/{d} went over MPI (must fall back to gloo)", flush=True)
for p, d in [("reduce_scatter", "float16")]:
    if (p, d) in over_mpi:
        failures.append(f"{p}/{d} went over MPI")
        print(f"FAIL {p}/{d} went over MPI (must fall back to gloo)", flush=True)
for p, d in [("all_to_all", "bfloat16"), ("reduce_scatter", "int8"), ("all_to_all", "bool"),
             ("all_to_all", "float64"), ("reduce_scatter", "uint64")]:
    if (p, d) not in over_mpi:
        failures.append(f"{p}/{d} did not go over MPI")
        print(f"FAIL {p}/{d} did not go over MPI", flush=True)
if not any(p.startswith("all_gather") and d == "float32" for p, d in over_mpi):
    failures.append("all_gather float32 did not go over MPI")
    print("FAIL all_gather float32 did not go over MPI", flush=True)
if ("psum_invariant", "float32") not in over_mpi:
    failures.append("psum float32 did not go over MPI")
    print("FAIL psum float32 did not go over MPI", flush=True)

# ---- under grad, vmap, scan, and without check_vma (psum_p itself)


def transformed(setting: str) -> dict:
    """The cases in two programs (one per case cost a compilation each): those under
    check_vma, and psum_p itself and pmax/pmin without it."""
    config.configure(collectives=setting)
    x = common.global_array(mesh, P("x"), values("float32", (6,), 7))
    xa = common.global_array(mesh, P("x"), values("float32", (2 * n,), 8))

    def loss(v):
        return jnp.sum(jax.lax.psum(v * v, "x") * jnp.arange(6.0, dtype=jnp.float32))

    def vmapped(v):  # a batch of 3 psums
        return jax.vmap(lambda r: jax.lax.psum(r, "x"))(jnp.stack([v, 2 * v, v + 1]))

    def scanned(v):
        def step(c, _):
            return jax.lax.pmean(c, "x") * 0.5 + c, None
        return jax.lax.scan(step, v, None, length=5)[0]

    # all_gather's transpose is psum_scatter; all_to_all under vmap (a batch of 2).
    w = jnp.arange(6.0 * n, dtype=jnp.float32).reshape(n, 6)

    def gather_loss(v):
        return jnp.sum(jax.lax.all_gather(v, "x", tiled=True) * w)

    def checked(v, va):
        return {"grad": jax.grad(loss)(v), "vmap": vmapped(v), "scan": scanned(v),
                "grad of all_gather": jax.grad(gather_loss)(v),
                "vmap of all_to_all": jax.vmap(
                    lambda r: jax.lax.all_to_all(r, "x", 1, 1, tiled=True))(
                        jnp.stack([va, 3 * va]))}

    batched = P(None, "x")
    f = jax.jit(jax.shard_map(checked, mesh=mesh, in_specs=P("x"), out_specs={
        "grad": P("x"), "vmap": batched, "scan": P("x"), "grad of all_gather": P("x"),
        "vmap of all_to_all": batched}))
    out = run_in(setting, "grad, vmap, scan",
                 lambda: {k: gather(r) for k, r in f(x, xa).items()})

    def unchecked(v):
        return {"psum_p (check_vma=False)": jax.lax.psum(v, "x"),
                "pmax-pmin (check_vma=False)": jax.lax.pmax(v, "x") - jax.lax.pmin(v, "x")}

    nv = jax.jit(jax.shard_map(unchecked, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                               check_vma=False))
    out.update(run_in(setting, "without check_vma",
                      lambda: {k: gather(r) for k, r in nv(x).items()}))
    return out


def close(name: str, got: np.ndarray, want: np.ndarray) -> None:
    try:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        print(f"ok   {name}", flush=True)
    except AssertionError as e:
        failures.append(name)
        print(f"FAIL {name}: {e}", flush=True)


t_mpi, t_gloo = transformed("mpi"), transformed("gloo")
for k in t_mpi:
    close(f"mpi  {k} vs gloo", t_mpi[k], t_gloo[k])

# ---- psums in a nested jit (called twice), a loop and a cond, beside independent ones: the
# ordering pass inlines the calls and chains every psum, through the loop and the cond (a
# nested jit's psum used to sit in a function of its own, unordered, sharing one site)


@jax.jit
def _doubled_psum(v):
    return jax.lax.psum(v * 2, "x")


def nested(v):
    looped = jax.lax.fori_loop(0, 3, lambda i, c: c + jax.lax.psum(c, "x") * 0.5, v)
    a = jax.lax.psum(v, "x")
    chosen = jax.lax.cond(jnp.sum(a) > 0, lambda u: u + jax.lax.psum(u, "x"), lambda u: u * 4,
                          v)
    return (a + _doubled_psum(v + 1) + jax.lax.psum(v * 3, "x") + looped +
            _doubled_psum(v * 5) + chosen)


config.configure(collectives="mpi")
v_nested = values("float32", (6,), 31)
f_nested = jax.jit(jax.shard_map(nested, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
x_nested = common.global_array(mesh, P("x"), v_nested)
text = f_nested.lower(x_nested).as_text()
sites = [line.split("site = ")[1].split(" ")[0] for line in text.splitlines()
         if "jax_cpu_mpi_all_reduce" in line]
got_nested = each_mode("nested psums", lambda: gather(f_nested(x_nested)))
looped = v_nested.copy()
for _ in range(3):
    looped = looped + looped.sum(0) * 0.5
total = v_nested.sum(0)
chosen = v_nested + total if total.sum() > 0 else v_nested * 4
want_nested = (total + 2 * (v_nested + 1).sum(0) + 3 * total + looped + 10 * total + chosen)
try:
    assert "func.call" not in text, "a function holding a psum was not inlined"
    assert len(sites) == 6 and len(set(sites)) == 6, f"sites {sites}"
    np.testing.assert_allclose(got_nested, np.broadcast_to(want_nested, got_nested.shape),
                               rtol=1e-5, atol=1e-4)
    print("ok   mpi  psums in a nested jit, a loop and a cond beside others vs numpy",
          flush=True)
except AssertionError as e:
    failures.append("nested psums")
    print(f"FAIL nested psums: {e}", flush=True)

# ---- two sibling shard_maps in one jit, each with psums: each is an sdy.manual_computation
# whose body reads nothing from outside, so the ordering pass carries the chain through one
# more operand and result of each. Each device spins before its psums for a time set by its
# axis index, longest first in one shard_map and last in the other, so the devices get to
# the two shard_maps' psums in opposite orders unless the chain orders them.


def _spin(v, turns):
    m = jnp.full((32, 32), 0.01, v.dtype)
    _, w = jax.lax.while_loop(lambda c: c[0] < turns,
                              lambda c: (c[0] + 1, jnp.tanh(c[1] @ m)), (0, m))
    return v + 0 * jnp.sum(w)


def _sibling(scale, late):
    def body(v):
        i = jax.lax.axis_index("x")
        a = jax.lax.psum(_spin(v * scale, 40 * (n - 1 - i if late else i)), "x")
        return a + jax.lax.psum(a, "x")
    return jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))


f_siblings = jax.jit(lambda v: (_sibling(1, False)(v), _sibling(3, True)(v)))
v_siblings = values("float32", (256,), 37)
x_siblings = common.global_array(mesh, P("x"), v_siblings)
lowered = f_siblings.lower(x_siblings)
compiled = lowered.compile()


def _twenty_rounds() -> list:
    for _ in range(20):
        got = jax.block_until_ready(compiled(x_siblings))
    return [gather(g) for g in got]


got_siblings = each_mode("sibling shard_maps", _twenty_rounds)
# Every psum but the first reads the one before it (an extra operand), in the module and
# after XLA's compilation.
operand_counts = [len(args.split(", ")) for args in re.findall(
    r"jax_cpu_mpi_all_reduce\(([^)]*)\)", lowered.as_text())]
compiled_counts = [len(args.split(", ")) for args in re.findall(
    r"custom-call\(([^)]*)\), custom_call_target=\"jax_cpu_mpi_all_reduce\"",
    compiled.as_text())]
try:
    assert operand_counts == [2, 3, 3, 3], f"psum operands in the module {operand_counts}"
    assert sorted(compiled_counts) == [2, 3, 3, 3], f"compiled psum operands {compiled_counts}"
    total = v_siblings.sum(0)
    for got, scale in zip(got_siblings, (1, 3), strict=True):
        np.testing.assert_allclose(got, np.broadcast_to((n + 1) * scale * total, (n, 256)),
                                   rtol=1e-5, atol=1e-3)
    print("ok   mpi  psums of two sibling shard_maps, chained, 20 rounds vs numpy", flush=True)
except AssertionError as e:
    failures.append("sibling shard_maps")
    print(f"FAIL sibling shard_maps: {e}", flush=True)

# ---- 2 devices per process: a loop of a psum, then a ppermute within each process (our
# psend/precv) that reads the other device's psum. A device resumed from a parked psum on the
# other device's thread could wait in the ppermute for the device suspended under it (the
# reviewer's deadlock, below), so this program never parks (passes/park_safety.py). 300
# rounds, every bit against NumPy.
if jax.local_device_count() == 2:
    swap = [(i, i ^ 1) for i in range(n)]  # partitions 2k and 2k+1 share a process

    def _psum_then_swap(v):
        def step(c, _):
            return jax.lax.ppermute(jax.lax.psum(c, "x"), "x", swap) + jax.lax.axis_index(
                "x").astype(c.dtype), None
        return jax.lax.scan(step, v, None, length=300)[0]

    v_swap = values("uint32", (8,), 41)
    f_swap = jax.jit(jax.shard_map(_psum_then_swap, mesh=mesh, in_specs=P("x"),
                                   out_specs=P("x"), check_vma=False))
    x_swap = common.global_array(mesh, P("x"), v_swap.reshape(-1))
    got_swap = each_mode("psum then ppermute", lambda: gather(f_swap(x_swap)))
    want_swap = v_swap.copy()
    for _ in range(300):
        total = want_swap.sum(0, dtype=np.uint32)
        want_swap = np.stack([total + np.uint32(i) for i in range(n)])
    try:
        np.testing.assert_array_equal(got_swap.reshape(n, 8), want_swap)
        print("ok   mpi  300 rounds of a psum and a ppermute within the process vs numpy",
              flush=True)
    except AssertionError as e:
        failures.append("psum then ppermute")
        print(f"FAIL psum then ppermute: {e}", flush=True)

    # The reviewer's reproducer of the parked design's deadlock: float32[32768] (large
    # enough that XLA runs the program as a dataflow graph), a psum, a ppermute within each
    # process, a psum. Where the first psum's non-leading device parked, it resumed on the
    # thread of the other device when that one entered the second psum, and XLA ran the
    # parked program's ready steps there: its precv then waited for the psend of the very
    # device suspended under it (8 failures in 27 runs, a timeout error each). Such a
    # program must take the waiting path, whatever JAX_CPU_MPI_PARK says: 40 calls, no
    # parked call among them, every value against NumPy.
    def _psum_swap_psum(v):
        y = jax.lax.ppermute(jax.lax.psum(v, "x"), "x", swap)
        return jax.lax.psum(y + jax.lax.axis_index("x").astype(y.dtype), "x")

    v_rep = (np.arange(n * 32768, dtype=np.int64) % 1000).astype(np.float32).reshape(n, -1)
    f_rep = jax.jit(jax.shard_map(_psum_swap_psum, mesh=mesh, in_specs=P("x"),
                                  out_specs=P("x"), check_vma=False))
    x_rep = common.global_array(mesh, P("x"), v_rep.reshape(-1))
    want_rep = np.tile(n * v_rep.sum(0) + n * (n - 1) / 2, n).astype(np.float32)
    for mode in MODES:  # the parking mode's is the case this guards
        meeting(mode)
        before_rep = parks()
        try:
            for _ in range(40):  # one call in flight at a time: psend/precv's rule
                np.testing.assert_array_equal(gather(f_rep(x_rep)), want_rep)
            assert parks() == before_rep, ("parked", parks() - before_rep)
            print("ok   mpi  psum, ppermute within the process, psum of float32[32768]: the "
                  f"waiting path, 40 calls vs numpy (park {mode})", flush=True)
        except Exception as e:  # a deadlock ends in the meeting's timeout error
            failures.append(f"psum ppermute psum (park {mode})")
            print(f"FAIL psum ppermute psum (park {mode}): {type(e).__name__}: "
                  f"{str(e)[:400]}", flush=True)
    meeting(MODES[0])

# ---- The psum after a loop or a conditional of psums waits for it, in the compiled program
# too: a loop that starts the chain (no psum before it: its trip counter, the first result,
# is what XLA folded into a constant), one after a psum (the value it passes through
# unchanged is what XLA replaced by the value before the loop), and a conditional. Each
# loop spins longer on one device than on the other, so a psum after it that did not wait
# would meet the loop's psum.


def _after(what: str):
    def body(v):
        i = jax.lax.axis_index("x")
        before = 0 if what == "first loop" else jax.lax.psum(v, "x")
        if what == "conditional":
            c = jax.lax.cond(v[0, 0] > -1e30,
                             lambda a: jax.lax.pcast(jax.lax.psum(_spin(a, 30 * i), "x"),
                                                     "x", to="varying"),
                             lambda a: a * 2, v)
        else:
            def step(c, _):
                return jax.lax.pcast(jax.lax.psum(_spin(c, 30 * i), "x") * 0.5, "x",
                                     to="varying"), None

            c, _ = jax.lax.scan(step, v, None, length=3)
        return jax.lax.psum(v * 3.0, "x") + c + before
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def _reads_a_token_of(hlo: str, op: str) -> bool:
    """Whether an all_reduce call's last operand is a scalar the compiled program takes
    from the results of a ``while`` or ``conditional``."""
    tokens = set(re.findall(rf"(%[\w.-]+) = s32\[\] get-tuple-element\(%{op}[\w.-]*\)",
                            hlo))
    lasts = [args.split(", ")[-1] for args in re.findall(
        r"custom-call\(([^)]*)\), custom_call_target=\"jax_cpu_mpi_all_reduce\"", hlo)]
    return any(last in tokens for last in lasts)


v_after = values("float32", (64,), 38)
x_after = common.global_array(mesh, P("x"), v_after)
total_after = v_after.sum(0)
c_loop = 0.5 * total_after  # the first step sums the devices' rows; the next, equal rows
for _ in range(2):
    c_loop = 0.5 * n * c_loop
for what, op, c_want, before_want in (
        ("first loop", "while", c_loop, 0),
        ("loop after a psum", "while", c_loop, total_after),
        ("conditional", "conditional", total_after, total_after)):
    compiled_after = _after(what).lower(x_after).compile()
    try:
        assert _reads_a_token_of(compiled_after.as_text(), op), (
            f"no psum after the {what} reads its token in the compiled program")
        want = 3.0 * total_after + c_want + before_want
        rounds = each_mode(f"psum after a {what}", lambda c=compiled_after: [
            gather(jax.block_until_ready(c(x_after))) for _ in range(10)])
        for got_after in rounds:
            np.testing.assert_allclose(got_after, np.broadcast_to(want, (n, 64)), rtol=1e-5,
                                       atol=1e-3)
        print(f"ok   mpi  the psum after a {what} reads its token, 10 rounds vs numpy",
              flush=True)
    except AssertionError as e:
        failures.append(f"psum after a {what}")
        print(f"FAIL psum after a {what}: {e}", flush=True)

# ---- axis_index_groups and scan for all_gather / psum_scatter / all_to_all (and psum), in
# one program per setting. The groups span processes and one lists its members out of
# order (2 devices: [[1, 0]]; 4: [[0, 2], [3, 1]]; 6: [[0, 2, 4], [5, 3, 1]]), so the
# exchanges' positions are not process after process.
GROUPS = {2: [[1, 0]], 4: [[0, 2], [3, 1]], 6: [[0, 2, 4], [5, 3, 1]]}[n]
g_len = len(GROUPS[0])
v_grp = values("int32", (2 * g_len, 3), 21)
v_scan = values("int32", (2 * n,), 22)


def grouped_and_scanned(setting: str) -> list:
    config.configure(collectives=setting)

    def body(a, c):
        a, c = a[0], c[0]
        kw = {"axis_name": "x", "axis_index_groups": GROUPS}

        def step(c, _):  # shapes kept: psum_scatter of the all_gather, plus an all_to_all
            g = jax.lax.all_gather(c, "x", tiled=True)
            return (jax.lax.psum_scatter(g, "x", tiled=True) +
                    jax.lax.all_to_all(c, "x", 0, 0, tiled=True)), None

        return [r[None] for r in (
            jax.lax.all_gather(a, axis=0, tiled=True, **kw),
            jax.lax.all_gather(a, axis=1, **kw),
            jax.lax.psum_scatter(a, scatter_dimension=0, tiled=True, **kw),
            jax.lax.all_to_all(a, split_axis=0, concat_axis=1, tiled=True, **kw),
            jax.lax.psum(a, **kw),
            jax.lax.scan(step, c, None, length=3)[0])]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                              check_vma=False))  # psum with groups needs check_vma=False
    args = (common.global_array(mesh, P("x"), v_grp), common.global_array(mesh, P("x"), v_scan))
    return run_in(setting, "axis_index_groups and scan",
                  lambda: [gather(o) for o in f(*args)])


before = lowering.decisions()
g_mpi = grouped_and_scanned("mpi")
lowered = {k: c - before.get(k, 0) for k, c in lowering.decisions().items()}
for prim in ("all_gather", "reduce_scatter", "all_to_all", "psum"):
    ours = sum(c for (p, _, how), c in lowered.items() if p == prim and how == "mpi")
    theirs = [how for (p, _, how), c in lowered.items() if p == prim and how != "mpi" and c]
    if not ours or theirs:
        failures.append(f"grouped/scanned {prim} not over MPI")
        print(f"FAIL grouped/scanned {prim} not over MPI: {theirs}", flush=True)
g_gloo = grouped_and_scanned("gloo")
g_want: list[list] = [[None] * n for _ in range(5)]
for grp in GROUPS:
    members = v_grp[grp]  # the group's operands, in group order
    total = members.sum(0, dtype=np.int32)
    for r, i in enumerate(grp):
        g_want[0][i] = np.concatenate(list(members), axis=0)
        g_want[1][i] = np.stack(list(members), axis=1)
        g_want[2][i] = np.split(total, g_len, axis=0)[r]
        g_want[3][i] = np.concatenate([np.split(m, g_len, axis=0)[r] for m in members], axis=1)
        g_want[4][i] = total
c_want = v_scan.copy()
for _ in range(3):
    c_want = np.stack([n * c_want[i] + np.concatenate(
        [np.split(c_want[j], n)[i] for j in range(n)]) for i in range(n)]).astype(np.int32)
names = [f"axis_index_groups={GROUPS} {k}" for k in
         ("all_gather tiled", "all_gather stacked", "psum_scatter", "all_to_all", "psum")]
for name, got, want, ref in zip([*names, "scan of all_gather, psum_scatter, all_to_all"],
                                g_mpi, [*map(np.stack, g_want), c_want], g_gloo, strict=True):
    try:  # every device's own result, bit for bit (int32)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, ref)
        print(f"ok   mpi  {name} vs numpy and gloo", flush=True)
    except AssertionError as e:
        failures.append(name)
        print(f"FAIL {name}: {e}", flush=True)

# ---- all_to_all of the leading axis as the carry of a scan, >= 256 KiB per device: XLA
# gives the result the operand's buffer, so every step is in place (with one device per
# process only the blocks for other processes are staged: LeadExchange). An odd number of
# steps: two all_to_alls of 2 devices give back the operand.
v_a2a = values("int32", (n << 16,), 23)


def scanned_all_to_all() -> np.ndarray:
    config.configure(collectives="mpi")

    def body(c):
        def step(c, _):
            return jax.lax.all_to_all(c, "x", 0, 0, tiled=True), None
        return jax.lax.scan(step, c[0], None, length=3)[0][None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = common.global_array(mesh, P("x"), v_a2a)
    return each_mode("scan of in-place all_to_all", lambda: gather(f(x)))


a2a_want = v_a2a.copy()
for _ in range(3):
    a2a_want = np.stack([np.concatenate([np.split(a2a_want[j], n)[i] for j in range(n)])
                         for i in range(n)])
try:
    np.testing.assert_array_equal(scanned_all_to_all(), a2a_want)
    print("ok   mpi  scan of in-place all_to_all/int32/big vs numpy", flush=True)
except AssertionError as e:
    failures.append("scan of in-place all_to_all")
    print(f"FAIL scan of in-place all_to_all/int32/big: {e}", flush=True)

# ---- The staging memory of an in-place all_to_all with one device per process: from a huge
# page up it is a map of its own advised for huge pages (StagingBuffer, HugePageMemory),
# which the peer's single copy out of it walks 2 MiB at a time. 5 MiB per device, made in the
# program (no NumPy array of that size, which NumPy advises itself): the stage of n blocks is
# then a 6 MiB range (whole huge pages) flagged "hg" in smaps; malloc's stage, memory of a
# thread's arena, had none, and an output XLA allocated is advised only over the whole huge
# pages inside it (at most 4 MiB of 5). Bytes checked against NumPy.
def _thp() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            return "[never]" not in fh.read()
    except OSError:
        return False


def _advised_vma_sizes() -> list[int]:
    sizes, size = [], 0
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                lo, hi = (int(a, 16) for a in fields[0].split("-"))
                size = hi - lo
            elif fields[0] == "VmFlags:" and "hg" in fields[1:]:
                sizes.append(size)
    return sizes


if jax.local_device_count() == 1 and jax.process_count() == 2:
    config.configure(collectives="mpi")
    stage_count = (5 << 20) // 4

    def _staged(v):
        def step(c, _):
            return jax.lax.all_to_all(c, "x", 0, 0, tiled=True), None
        c0 = jnp.arange(stage_count, dtype=jnp.int32) + v[0]
        return jax.lax.scan(step, c0, None, length=3)[0]

    try:
        got = gather(jax.jit(jax.shard_map(_staged, mesh=mesh, in_specs=P("x"),
                                           out_specs=P("x")))(
            common.global_array(mesh, P("x"), np.arange(2, dtype=np.int32) * 1000)))
        blocks = [np.split(np.arange(stage_count, dtype=np.int32) + 1000 * d, n)
                  for d in range(n)]
        want = blocks
        for _ in range(3):  # block j of device i: device j's block i
            want = [[want[j][i] for j in range(n)] for i in range(n)]
        np.testing.assert_array_equal(got, np.concatenate([np.concatenate(w) for w in want]))
        if _thp():
            assert (6 << 20) in _advised_vma_sizes(), _advised_vma_sizes()
        print("ok   mpi  in-place all_to_all of 5 MiB: its stage advised for huge pages",
              flush=True)
    except AssertionError as e:
        failures.append("in-place all_to_all stage on huge pages")
        print(f"FAIL in-place all_to_all stage on huge pages: {e}", flush=True)

# ---- 2-D meshes: each axis and both (2 devices per process: one axis inside processes)
if n == 4:
    mesh2 = jax.make_mesh((2, 2), ("p", "d"))
    v = values("int32", (2, 3), 11).reshape(2, 2, 2, 3)

    psum_axes = ("p", "d", ("p", "d"))

    def two_d(setting):  # the psum over each axis and both, in one program
        config.configure(collectives=setting)
        f = jax.jit(jax.shard_map(lambda a: tuple(jax.lax.psum(a, ax) for ax in psum_axes),
                                  mesh=mesh2, in_specs=P("p", "d"), out_specs=P("p", "d")))
        x = common.global_array(mesh2, P("p", "d"), v)
        return run_in(setting, "2-D psums", lambda: [gather(r) for r in f(x)])

    for axes, got, ref in zip(psum_axes, two_d("mpi"), two_d("gloo"), strict=True):
        axis_ix = {"p": (0,), "d": (1,), ("p", "d"): (0, 1)}[axes]
        want = np.broadcast_to(v.sum(axis_ix, keepdims=True, dtype=np.int32), v.shape)
        check(f"2-D psum over {axes} vs numpy", got[None], want.astype(np.int32), True)
        check(f"2-D psum over {axes} vs gloo", got[None], ref, True)

    # all_gather / psum_scatter / all_to_all over one axis and both, in one program each.
    def two_d_exchanges(setting):
        config.configure(collectives=setting)

        def body(a):
            a = a[0, 0]  # (2, 3) int32 per device
            return (jax.lax.all_gather(a, "p", axis=0)[None, None],
                    jax.lax.all_gather(a, ("p", "d"), axis=1, tiled=True)[None, None],
                    jax.lax.psum_scatter(a, "p", scatter_dimension=0, tiled=True)[None, None],
                    jax.lax.psum_scatter(jnp.tile(a, (2, 1)), ("p", "d"),
                                         scatter_dimension=0, tiled=True)[None, None],
                    jax.lax.all_to_all(a, "p", 0, 1, tiled=True)[None, None],
                    jax.lax.all_to_all(jnp.tile(a, (2, 1)), ("p", "d"), 0, 0,
                                       tiled=True)[None, None])

        f = jax.jit(jax.shard_map(body, mesh=mesh2, in_specs=P("p", "d"),
                                  out_specs=P("p", "d")))
        x = common.global_array(mesh2, P("p", "d"), v)
        return run_in(setting, "2-D exchanges", lambda: [gather(r) for r in f(x)])

    names = ["all_gather p", "all_gather (p, d) tiled", "psum_scatter p",
             "psum_scatter (p, d)", "all_to_all p", "all_to_all (p, d)"]
    exchanged = two_d_exchanges("mpi")
    for name, got, ref in zip(names, exchanged, two_d_exchanges("gloo"), strict=True):
        check(f"2-D {name} vs gloo", got[None], ref, True)
    # NumPy: the gather over p of device (p, d) is v[:, d] stacked.
    got = exchanged[0]
    check("2-D all_gather p vs numpy", got[None, 0, 1],
          np.stack([v[0, 1], v[1, 1]]), True)

# ---- the timeline: each collective over MPI is a slice with its bytes and wait (in each
# park mode: a parked call's slice is written when it completes)
config.configure(collectives="mpi")


def four(v):  # one of each kind of slice: all_reduce, all_gather, all_to_all, reduce_scatter
    g = jax.lax.all_gather(v, "x", tiled=True)
    return (jax.lax.psum(v, "x"), g, jax.lax.all_to_all(g, "x", 0, 0, tiled=True),
            jax.lax.psum_scatter(g, "x", tiled=True))


traced = jax.jit(jax.shard_map(four, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                               check_vma=False))
xt = common.global_array(mesh, P("x"), np.ones((n, 6), np.float32))
jax.block_until_ready(traced(xt))
for mode in MODES:
    meeting(mode)
    tag = f" (park {mode})" if len(MODES) > 1 else ""
    with tempfile.TemporaryDirectory() as tmp:
        directory = os.path.join(tmp, "trace")
        with jax_cpu_mpi.trace(directory):
            jax.block_until_ready(traced(xt))
        mine = [e for f in glob.glob(os.path.join(directory, "*.json"))
                for e in json.load(open(f))["traceEvents"]
                if e.get("cat") == "collective" and e["pid"] == jax.process_index()]
    # bytes: the operand's, or the result's where larger (24 B per device, n x 24 B gathered)
    want = {"all_reduce": 24, "all_gather": 24 * n, "all_to_all": 24 * n,
            "reduce_scatter": 24 * n}
    by_name = {k: [e for e in mine if e["name"] == k] for k in want}
    if any(len(by_name[k]) != jax.local_device_count() or any(
            e["args"]["bytes"] != b or e["args"]["wait_us"] < 0 or not e["args"]["ok"]
            for e in by_name[k]) for k, b in want.items()):
        failures.append(f"timeline{tag}")
        print(f"FAIL timeline{tag}: {mine}", flush=True)
    else:
        print(f"ok   timeline{tag}: {jax.local_device_count()} slice(s) each of "
              f"{', '.join(want)}", flush=True)
meeting(MODES[0])

# ---- ppermute between processes: precv(psend(x)) over MPI, against gloo, 8 B to 1 MiB


def permuted(setting: str) -> dict:
    """Every case's ppermute in one program (a program per case cost a compilation each)."""
    config.configure(collectives=setting)
    cases = {}
    for name, perm in (("ring", [(i, (i + 1) % n) for i in range(n)]),
                       ("reverse pair", [(n - 1, 0)])):
        for shape in ((2,), (1 << 18,)):
            cases[f"ppermute {name} int32{list(shape)}"] = (values("int32", shape, 5), perm)

    def body(tree):
        return {k: jax.lax.ppermute(tree[k], "x", cases[k][1]) for k in sorted(tree)}

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    xs = {k: common.global_array(mesh, P("x"), v) for k, (v, _) in cases.items()}
    got = run_in(setting, "ppermutes", lambda: {k: gather(r) for k, r in f(xs).items()})
    return {k: (got[k], v, perm) for k, (v, perm) in cases.items()}


p_mpi, p_gloo = permuted("mpi"), permuted("gloo")
for k, (got, v, perm) in p_mpi.items():
    want = np.zeros_like(v)
    for src, dst in perm:
        want[dst] = v[src]
    try:
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, p_gloo[k][0])
        print(f"ok   mpi  {k} vs numpy and gloo", flush=True)
    except AssertionError as e:
        failures.append(k)
        print(f"FAIL {k}: {e}", flush=True)
if not any(p == "ppermute" and how == "mpi" for (p, _, how) in lowering.decisions()):
    failures.append("ppermute never went over MPI")
    print("FAIL ppermute never went over MPI", flush=True)

# ---- an axis that stays inside each process, in a mesh that spans processes: over MPI too
# (XLA would run it on gloo, over TCP between the process's own devices)
if n == 2 * jax.local_device_count() and jax.local_device_count() > 1:
    local = jax.local_device_count()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh2 = jax.sharding.Mesh(np.array(devices).reshape(2, local), ("p", "l"))
    v = values("float32", (5,), 7)
    got = {}
    for setting in ("mpi", "gloo"):
        config.configure(collectives=setting)
        before = lowering.decisions()
        # psum and pmax in one program
        f = jax.jit(jax.shard_map(lambda a: (OPS["psum"](a, "l"), OPS["pmax"](a, "l")),
                                  mesh=mesh2, in_specs=P(("p", "l")), out_specs=P(("p", "l"))))
        x = common.global_array(mesh2, P(("p", "l")), v)
        got[setting, "psum"], got[setting, "pmax"] = run_in(
            setting, "psum and pmax over the in-process axis",
            lambda f=f, x=x: [gather(r) for r in f(x)])
        new = {k: c - before.get(k, 0) for k, c in lowering.decisions().items()}
        how = {h for (_, d, h), c in new.items() if c and d == "float32"}
        if setting == "mpi" and how != {"mpi"}:
            failures.append(f"in-process axis lowered as {how}")
            print(f"FAIL in-process axis of a multi-process mesh lowered as {how}", flush=True)
    for name in ("psum", "pmax"):
        key = f"{name} over the in-process axis of a 2-process mesh"
        want = np.repeat(np.stack([NUMPY[name](g) for g in v.reshape(2, local, 5)]), local,
                         axis=0)
        try:
            np.testing.assert_allclose(got["mpi", name], want, rtol=1e-6)
            if local <= 2:
                np.testing.assert_array_equal(got["mpi", name], got["gloo", name])
            else:  # gloo's ring sums 3 or more members in another order for some elements
                np.testing.assert_allclose(got["mpi", name], got["gloo", name], rtol=1e-6)
            print(f"ok   mpi  {key} vs numpy and gloo", flush=True)
        except AssertionError as e:
            failures.append(key)
            print(f"FAIL {key}: {e}", flush=True)

# ---- exported for CPU and CUDA at once: each collective sits in a branch per platform, and
# nothing of ours may land outside the CPU's (the chain's end, collectives_end, goes nowhere:
# the GPU has no such target). The CPU side runs and equals NumPy.
config.configure(collectives="mpi")
try:
    f_both = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"),
                                   out_specs=P("x"), check_vma=False))
    v_both = values("float32", (4,), 17)
    exported = jax.export.export(
        f_both, platforms=["cpu", "cuda"],
        # Our calls (the psum, the ordering pass's token after the platform's conditional)
        # have no compatibility guarantee across jax-cpu-mpi versions.
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t)
                         for t in (lowering.ALL_REDUCE_TARGET, ORDER_TOKEN_TARGET)],
    )(jax.ShapeDtypeStruct((n * 4,), np.float32, sharding=jax.NamedSharding(mesh, P("x"))))
    text = exported.mlir_module()
    assert lowering.ALL_REDUCE_TARGET in text and "all_reduce" in text.replace(
        lowering.ALL_REDUCE_TARGET, ""), "not both platforms' psum"
    assert lowering.END_TARGET not in text, "collectives_end outside the CPU branch"
    call_both = jax.jit(exported.call)
    x_both = common.global_array(mesh, P("x"), v_both.reshape(-1))
    got = each_mode("exported for cpu and cuda", lambda: gather(call_both(x_both)))
    check("mpi  exported for cpu and cuda: psum vs numpy", got.reshape(n, 4), v_both.sum(0),
          False)
except Exception as e:
    failures.append("exported for cpu and cuda")
    print(f"FAIL exported for cpu and cuda: {type(e).__name__}: {str(e)[:400]}", flush=True)

# ---- a partially manual shard_map (axis_names= a subset): XLA's SPMD partitioner refuses
# our calls' partition-id there, so they keep JAX's lowering, recorded as such, and the
# program compiles and runs (it failed to compile before: "PartitionId instruction is not
# supported for SPMD partitioning"). "d" is of size 1 with one device per process.
mesh_pd = jax.make_mesh((2, n // 2), ("p", "d"))
v = values("int32", (4, 3), 13)[:2]


def partly_manual(setting: str) -> list:
    config.configure(collectives=setting)

    def body(a):
        return (jax.lax.psum(a, "p"), jax.lax.all_gather(a, "p", axis=0, tiled=True),
                jax.lax.ppermute(a, "p", [(0, 1), (1, 0)]))

    f = jax.jit(jax.shard_map(body, mesh=mesh_pd, in_specs=P("p"), out_specs=P("p"),
                              axis_names={"p"}))
    return [gather(r) for r in f(common.global_array(mesh_pd, P("p"), v))]


before = lowering.decisions()
try:
    got, ref = partly_manual("mpi"), partly_manual("gloo")
    new = {k: c - before.get(k, 0) for k, c in lowering.decisions().items()}
    how = {h for (_, _, h), c in new.items() if c and "gloo" in h and "selects gloo" not in h}
    assert how == {"gloo: partially manual shard_map (XLA refuses partition-id there)"}, new
    assert not any(h == "mpi" and c for (_, _, h), c in new.items()), new
    wants = [np.concatenate([v.sum(0, keepdims=True, dtype=np.int32)] * 2),
             np.concatenate([v, v]), v[::-1]]
    for name, g, r, w in zip(("psum", "all_gather", "ppermute"), got, ref, wants, strict=True):
        check(f"partially manual shard_map {name} vs numpy", g[None], w, True)
        check(f"partially manual shard_map {name} vs gloo", g[None], r, True)
except Exception as e:  # a compile error is this case's failure
    failures.append("partially manual shard_map")
    print(f"FAIL partially manual shard_map: {type(e).__name__}: {str(e)[:400]}", flush=True)


# ---- merged all-reduces (passes/combined_all_reduces.py): a pytree's small leaves of one
# dtype and reduction go as one call; a leaf above JAX_CPU_MPI_COMBINE_BYTES, a psum of a
# psum's result and a psum of a value read from an earlier one stay calls of their own. The
# matrix above merges too (its small cases share one program); here the number of calls is
# checked, and the results against the same program with merging off, bit for bit.
def tree_step(a, b, c, d, e, f, g, h):
    # a, b, d and a 0-d leaf merge; c (int32) alone.
    *first, scalar = jax.lax.psum((a, b, c, d, h[0, 0]), "x")
    big = jax.lax.psum(e, "x")  # 512 KiB: above the default limit
    again = jax.lax.psum(first[0] * 3, "x")  # reads a merged result: a call of its own
    peaks = jax.lax.pmax((a, b), "x")  # another reduction: merged apart
    flags = jax.lax.pmax((f, g), "x")  # bools (a byte each in the merged buffer): merged
    return (*first, scalar[None], big, again, *peaks, *flags)


def tree_program(setting: str, combine: int):
    config.configure(collectives=setting, combine_bytes=combine)
    f = jax.jit(jax.shard_map(tree_step, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    args = [common.global_array(mesh, P("x"), v) for v in tree_operands]
    calls = f.lower(*args).as_text().count("@jax_cpu_mpi_all_reduce(")
    return calls, run_in(setting, f"merged all-reduces, combine_bytes={combine}",
                         lambda: [gather(r) for r in f(*args)])


tree_operands = [values("float32", (3, 5), 201), values("float32", (1,), 202),
                 values("int32", (7,), 203), values("float32", (2, 2), 204),
                 values("float32", (1 << 17,), 205),
                 # Bools of one pattern on every device (their pmax is the pattern, where
                 # random ones would be mostly true and hide a misplaced slice).
                 np.tile(np.array([1, 0, 0, 1, 0], bool), (n, 1)),
                 np.tile(np.array([[0, 1, 1], [0, 0, 1]], bool), (n, 1, 1)),
                 values("float32", (1,), 208)]
try:
    merged_calls, merged = tree_program("mpi", 256 << 10)
    apart_calls, apart = tree_program("mpi", 0)
    _, reference = tree_program("gloo", 256 << 10)
    config.configure(combine_bytes=256 << 10)
    assert (merged_calls, apart_calls) == (6, 11), (merged_calls, apart_calls)
    for i, (m_, a_, r_) in enumerate(zip(merged, apart, reference, strict=True)):
        check(f"merged all-reduces, result {i} vs separate calls", m_, a_[0], True)
        check(f"merged all-reduces, result {i} vs gloo", m_, r_[0],
              m_.dtype.kind in "iub" or n <= 2)
except Exception as e:  # a compile error is this case's failure
    failures.append("merged all-reduces")
    print(f"FAIL merged all-reduces: {type(e).__name__}: {str(e)[:400]}", flush=True)

if failures:
    raise SystemExit(f"{len(failures)} failures: {failures}")
common.ok()
