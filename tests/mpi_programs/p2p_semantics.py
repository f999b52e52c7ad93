"""Every psend/precv scenario over all devices of an mpirun job (1 or 2 devices per rank).

Run by tests/runtime/test_p2p_mpi.py. Prints one line per scenario, then JCM-OK. Like the
single-process semantics tests, it runs with GPU parity off (cyclic pairs in one op are
transport semantics here), except for the patterns XLA GPU accepts.
"""

import json
import os
import resource
import sys

import _mpi_common as common
import jax
import numpy as np
import p2p_cases as cases

from jax_cpu_mpi import _jax_cpu_mpi as ext
from jax_cpu_mpi import config
from jax_cpu_mpi import stats as jax_cpu_mpi_stats

config.configure(gpu_parity=False)
#: JCM_TEST_SMALL_MESSAGES_ONLY=1 (tests/ops/test_without_jax_p2p.py's rerun without JAX's
#: psend/precv): the cases that differ from the others in their sizes only are left out:
#: their programs lower to the same custom calls whoever's primitive was bound, so only
#: the extension's handlers see what they add, as in the suite's own runs of this program.
LARGE = os.environ.get("JCM_TEST_SMALL_MESSAGES_ONLY") != "1"
n = jax.device_count()
mesh = jax.make_mesh((n,), ("x",))


#: Arrays from this size are gathered by JAX, as before: pickled through mpi4py, their copies
#: churn the main heap, where a freed 64 MiB block may then be found again by the malloc
#: check at the end (without the freed memory kept it expects a fresh map).
GATHERED_BY_JAX_BYTES = 1 << 20


def gather(x: jax.Array) -> np.ndarray:
    """The full value of ``x`` on every process, put together from every process's shards
    with an MPI allgather (mpi4py: the launcher attached MPI at initialize). JAX's
    ``process_allgather`` (``_mpi_common.gather``) compiles an all-gather program for each
    shape, dtype and mesh: a third of this launch's compiles, none of them what it checks."""
    if x.nbytes >= GATHERED_BY_JAX_BYTES:
        return common.gather(x)
    return common.gather_over_mpi(x)


failures = []


def unmoved(x: jax.Array) -> jax.Array:
    """The ``gather`` of the large cases whose result the case returns as it is (``got``, and
    ``want`` where it is ppermute's): left where it is, each process checks the elements it
    holds (:func:`held_here`) instead of moving tens of MiB to every process first."""
    return x


def held_here(got, want) -> tuple[np.ndarray, np.ndarray]:
    """``got`` and ``want`` as NumPy: where ``got`` is a global array, the elements of its
    shards on this process (flattened, one after the other) and the same elements of
    ``want`` (a NumPy array of the full value, or an array sharded as ``got``)."""
    if not isinstance(got, jax.Array):
        return got, want
    shards = [s for s in got.addressable_shards if s.replica_id == 0]
    if isinstance(want, jax.Array):
        theirs = {s.device: s for s in want.addressable_shards}
        assert all(theirs[s.device].index == s.index for s in shards), "sharded unlike got"
        wanted = [np.asarray(theirs[s.device].data) for s in shards]
    else:
        wanted = [want[s.index] for s in shards]
    return (np.concatenate([np.asarray(s.data).ravel() for s in shards]),
            np.concatenate([w.ravel() for w in wanted]))


def check(name, pair, exact=True):
    got, want = held_here(*pair)
    try:
        if exact:
            assert got.dtype == want.dtype, (got.dtype, want.dtype)
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-6)
        print(f"ok   {name}", flush=True)
    except AssertionError as e:
        failures.append(name)
        print(f"FAIL {name}: {e}", flush=True)


ring = [(i, (i + 1) % n) for i in range(n)]
check("ring", cases.permute_vs_ppermute(mesh, gather, axis="x", perm=ring))
check("reverse ring", cases.permute_vs_ppermute(
    mesh, gather, axis="x", perm=[((i + 1) % n, i) for i in range(n)]))
check("partial (zeros at non-destinations)", cases.permute_vs_ppermute(
    mesh, gather, axis="x", perm=[(n - 1, 0)]))
jax.config.update("jax_enable_x64", True)
# Every dtype in one program (and one ppermute program): a case each, as alone.
for dtype, pair in zip(cases.ALL_DTYPES, cases.permute_vs_ppermute_per_dtype(
        mesh, gather, axis="x", perm=ring, dtypes=cases.ALL_DTYPES, block=(2, 3)), strict=True):
    check(f"dtype {np.dtype(dtype).name}", pair)
# 32 bytes: the size of the chunked protocol's header, must still arrive as plain data.
check("32-byte messages", cases.permute_vs_ppermute(mesh, gather, axis="x", perm=ring,
                                                      dtype=np.float32, block=(8,)))


def whole_huge_pages(start: int, nbytes: int) -> tuple[int, int]:
    """The 2 MiB-aligned range of the whole huge pages inside [start, start + nbytes)."""
    huge = 2 << 20
    return -(-start // huge) * huge, (start + nbytes) // huge * huge


def smaps_over(start: int, nbytes: int, field: str):
    """(lo, hi, the line's fields) for each line ``field`` of /proc/self/smaps in a VMA
    [lo, hi) that overlaps the whole huge pages inside [start, start + nbytes)."""
    first, last = whole_huge_pages(start, nbytes)
    with open("/proc/self/smaps") as smaps:
        lo = hi = 0
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                lo, hi = (int(a, 16) for a in fields[0].split("-"))
            elif fields[0] == field and hi > first and lo < last:
                yield lo, hi, fields


def receiver_shard(cross: jax.sharding.Mesh, body, operand: np.ndarray) -> jax.Array | None:
    """``body`` under shard_map over the 2-device mesh ``cross`` (axis "x"), on ``operand``
    split over it: the output's shard on the second device (the receiver) on its process,
    None on the other process."""
    spec = jax.sharding.PartitionSpec("x")
    f = jax.jit(jax.shard_map(body, mesh=cross, in_specs=spec, out_specs=spec))
    out = jax.block_until_ready(f(cases.put(cross, spec, operand)))
    receiver = cross.devices.flat[1]
    if receiver.process_index != jax.process_index():
        return None
    return next(s.data for s in out.addressable_shards if s.device == receiver)


def huge_page_advice(nbytes: int) -> dict | None:
    """One way from the first device of rank 0 to the first of rank 1, ``nbytes`` (made in the
    program: no NumPy array of that size, which NumPy advises itself, comes near it): on the
    receiving process, whether the VMAs over the whole huge pages of the precv's output are
    advised for huge pages (smaps' VmFlags ``hg``, cpp/ffi/p2p_handlers.cc), and whether the
    bytes arrived. None on the sending process."""
    count = nbytes // 4
    per_process = n // jax.process_count()
    cross = jax.make_mesh((2,), ("x",), devices=[jax.devices()[0], jax.devices()[per_process]])

    def body(v):
        message = jax.numpy.arange(count, dtype=np.uint32) + v[0]
        return cases.sendrecv(message, "x", [(0, 1)])

    shard = receiver_shard(cross, body, np.arange(2, dtype=np.uint32))
    if shard is None:
        return None
    start = shard.unsafe_buffer_pointer()
    advised = ["hg" in fields[1:] for _, _, fields in smaps_over(start, nbytes, "VmFlags:")]
    return {"advised": bool(advised) and all(advised), "vmas": len(advised),
            "right": bool((np.asarray(shard) == np.arange(count, dtype=np.uint32)).all())}


# A 6 MiB receive, before any other large one in this process: its output, fresh memory,
# is advised for huge pages (as NumPy advises its arrays from 4 MiB), so that MPI's copy
# into it, and every later use of it, goes through 2 MiB pages.
if LARGE:
    print("hugepage " + json.dumps(huge_page_advice(6 << 20)), flush=True)


def huge_coverage(start: int, nbytes: int) -> tuple[int, int]:
    """Bytes of the whole huge pages inside [start, start + nbytes) that smaps says are
    huge pages (each VMA's AnonHugePages, at most its part inside), and those pages' bytes."""
    first, last = whole_huge_pages(start, nbytes)
    covered = sum(min(int(fields[1]) << 10, min(hi, last) - max(lo, first))
                  for lo, hi, fields in smaps_over(start, nbytes, "AnonHugePages:"))
    return covered, last - first


def carry_huge_pages(nbytes: int) -> dict | None:
    """Round trips of ``nbytes`` between the first devices of ranks 0 and 1 in a scan whose
    carry starts from values the program computes: XLA writes them into the carry's buffers
    before any precv runs, which then have 4 KiB pages (unadvised memory where THP is
    "madvise"), and each step receives into the same buffers again. On the process of the
    first receiver: how much of the whole huge pages of its received carry are huge pages
    after the loop (huge_coverage; cpp/common/keep_freed_memory.h, CollapseReusedBuffer), and
    whether the bytes arrived. None on the other process."""
    count = nbytes // 4
    per_process = n // jax.process_count()
    cross = jax.make_mesh((2,), ("x",), devices=[jax.devices()[0], jax.devices()[per_process]])

    def body(v):
        z0 = jax.numpy.arange(count, dtype=np.uint32) + v[0]
        y0 = jax.numpy.arange(count, dtype=np.uint32) * np.uint32(3) + v[0]

        def round_trip(carry, _):
            y = jax.lax.pcast(cases.sendrecv(carry[0], "x", [(0, 1)]), "x", to="varying")
            z = jax.lax.pcast(cases.sendrecv(y, "x", [(1, 0)]), "x", to="varying")
            return (z, y), None

        return jax.lax.scan(round_trip, (z0, y0), None, length=3)[0][1]

    shard = receiver_shard(cross, body, np.zeros(2, dtype=np.uint32))
    if shard is None:
        return None
    covered, whole = huge_coverage(shard.unsafe_buffer_pointer(), nbytes)
    return {"huge_bytes": covered, "range_bytes": whole,
            "right": bool((np.asarray(shard) == np.arange(count, dtype=np.uint32)).all())}


# A loop's carry of 6 MiB that XLA wrote before the first receive into it: collapsed into
# huge pages the second time it receives (where the kernel has MADV_COLLAPSE).
if LARGE:
    print("carryhuge " + json.dumps(carry_huge_pages(6 << 20)), flush=True)


def _operand_and_sends(count: int, sends: int):
    """The cross-process pair (the first device of each of two processes), a program that
    makes a ``count``-element uint32 operand there (``arange + v[0]``, written by XLA
    unadvised) and one that sends it ``sends`` times from the first device to the second
    (the received array carried), and the two devices."""
    per_process = n // jax.process_count()
    cross = jax.make_mesh((2,), ("x",), devices=[jax.devices()[0], jax.devices()[per_process]])
    spec = jax.sharding.PartitionSpec("x")
    make = jax.jit(jax.shard_map(lambda v: jax.numpy.arange(count, dtype=np.uint32) + v[0],
                                 mesh=cross, in_specs=spec, out_specs=spec))

    def body(v):
        def step(carry, _):
            source = jax.lax.optimization_barrier(v)
            return jax.lax.pcast(cases.sendrecv(source, "x", [(0, 1)]), "x", to="varying"), None

        return jax.lax.scan(step, jax.numpy.zeros_like(v), None, length=sends)[0]

    f = jax.jit(jax.shard_map(body, mesh=cross, in_specs=spec, out_specs=spec))
    sender, receiver = cross.devices.flat
    return cross, spec, make, f, sender, receiver


def sent_operand_huge_pages(nbytes: int) -> dict | None:
    """Three one-way hops from the first device of rank 0 to the first of rank 1 of the same
    operand, a parameter that another program computed (XLA wrote it unadvised: 4 KiB pages
    where THP is "madvise"): on the sending process, how much of the operand's whole huge
    pages are huge pages after them (collapsed at its second send, CollapseReusedBuffer);
    on both, whether the bytes that this process holds arrived."""
    count = nbytes // 4
    cross, spec, make, f, sender, receiver = _operand_and_sends(count, 3)
    x = make(cases.put(cross, spec, np.zeros(2, dtype=np.uint32)))
    out = jax.block_until_ready(f(x))
    right = all(bool((np.asarray(s.data) == np.arange(count, dtype=np.uint32)).all())
                for s in out.addressable_shards if s.device == receiver)
    if sender.process_index != jax.process_index():
        return {"right": right}
    shard = next(s.data for s in x.addressable_shards if s.device == sender)
    covered, whole = huge_coverage(shard.unsafe_buffer_pointer(), nbytes)
    return {"huge_bytes": covered, "range_bytes": whole, "right": right}


# A 10 MiB parameter sent at every step: collapsed into huge pages at its second send.
if LARGE:
    print("sendhuge " + json.dumps(sent_operand_huge_pages(10 << 20)), flush=True)


def recycled_operand_huge_pages(nbytes: int, rounds: int = 4, sends: int = 6) -> dict | None:
    """``rounds`` times: a new operand of ``nbytes`` that another program computed (4 KiB
    pages where THP is "madvise"), sent ``sends`` times from the first device of rank 0 to
    the first of rank 1, and freed. From 32 MiB glibc maps such a block afresh and unmaps it
    when it is freed (without JAX_CPU_MPI_KEEP_FREED_MEMORY), and the next one lands at the
    same address over new pages: a collapse known by its address alone misses them. On the
    sending process: each operand's address relative to the first's, how much of its whole
    huge pages were huge pages before its sends and after them (CollapseReusedBuffer asks the
    kernel), and those pages' bytes; on both, whether the bytes that this process holds
    arrived."""
    count = nbytes // 4
    cross, spec, make, f, sender, receiver = _operand_and_sends(count, sends)
    addresses, before, after, whole, right = [], [], [], 0, True
    for r in range(rounds):
        x = jax.block_until_ready(make(cases.put(cross, spec, np.full(2, r, dtype=np.uint32))))
        shard = next((s.data for s in x.addressable_shards if s.device == sender), None)
        if shard is not None:
            addresses.append(shard.unsafe_buffer_pointer())
            before.append(huge_coverage(addresses[-1], nbytes)[0])
        out = jax.block_until_ready(f(x))
        right = right and all(
            bool((np.asarray(s.data) == np.arange(count, dtype=np.uint32) + r).all())
            for s in out.addressable_shards if s.device == receiver)
        if shard is not None:
            covered, whole = huge_coverage(addresses[-1], nbytes)
            after.append(covered)
        del x, shard, out  # freed before the next round's operand is made
    if sender.process_index != jax.process_index():
        return {"right": right}
    return {"addresses": [a - addresses[0] for a in addresses], "before": before,
            "after": after, "range_bytes": whole, "right": right}


# New 40 MiB operands, each sent six times, at one recycled address: each is collapsed
# into huge pages at its second send, as the first was.
if LARGE:
    print("recycledhuge " + json.dumps(recycled_operand_huge_pages(40 << 20)), flush=True)


# Just above the chunking threshold (4 MiB, cpp/mpi/framing.h), with a ragged last chunk: the
# chunked path of any larger size, for fewer bytes.
if LARGE:
    check("chunked 4 MiB + 12 B messages", cases.permute_vs_ppermute(
        mesh, unmoved, axis="x", perm=ring, dtype=np.float32, block=((1 << 20) + 3,)))
# 64 KiB and 16 KiB: a cycle's messages from 16 KiB take the rendezvous path (hops in the
# process and over MPI in one ring when a process has several devices).
check("ring of 64 KiB messages", cases.permute_vs_ppermute(
    mesh, gather, axis="x", perm=ring, dtype=np.float32, block=(16 << 10,)))
check("reverse ring of 16 KiB messages", cases.permute_vs_ppermute(
    mesh, gather, axis="x", perm=[((i + 1) % n, i) for i in range(n)], dtype=np.float32,
    block=(4 << 10,)))
check("0-d arrays", cases.scalar_blocks(mesh, gather, dtype=np.float64))
jax.config.update("jax_enable_x64", False)
for kind in ("scan", "fori_loop", "while_loop", "cond"):
    check(f"control flow {kind}", cases.loop_hops(mesh, gather, kind=kind))
with config.overrides(gpu_parity=True):
    check("manual pipeline", cases.manual_pipeline(mesh, gather), exact=False)
for count in (2, 1 << 17) if LARGE else (2,):  # 8 B and 512 KiB: eager/staged and direct
    for trial, pair in enumerate(cases.pytree_leaves_in_place_calls(mesh, gather, count=count,
                                                                    calls=2)):
        check(f"pytree leaves in place, {4 * count} B, trial {trial}", pair)
check("fifo on one pair", cases.fifo_same_pair(mesh, gather))
if LARGE:
    check("fifo on one pair, chunked (4 MiB + 12 B) then small",
          cases.fifo_same_pair(mesh, gather, counts=((1 << 20) + 3, 5)))

if n >= 4:
    mesh2 = jax.make_mesh((2, n // 2), ("x", "y"))
    spec = jax.sharding.PartitionSpec(("x", "y"))
    for axis, size in (("x", 2), ("y", n // 2), (("x", "y"), n)):
        perm = [(i, (i + 1) % size) for i in range(size)]
        check(f"2-D mesh axis {axis}", cases.permute_vs_ppermute(
            mesh2, gather, axis=axis, perm=perm, spec=spec))

# Pairs whose devices sit in different processes (first device of rank 0 and of rank 1).
per_process = n // jax.process_count()
cross = jax.make_mesh((2,), ("x",), devices=[jax.devices()[0], jax.devices()[per_process]])
assert cross.devices.flat[0].process_index != cross.devices.flat[1].process_index
with config.overrides(gpu_parity=True):
    check("send, compute, send back", cases.send_compute_send_back(cross, gather), exact=False)

check("two-way 64 KiB exchange, sends first",
      cases.two_way_exchange(cross, gather, nbytes=64 << 10))
# The two-op exchange whose results the program reads elementwise: the zeros of the op a
# device is no destination of are selected in the reading fusion, not written by the precv
# (passes/selected_zeros.py), in the step or after the loop that carries them ("carried").
# 8 B (eager), 64 KiB (framed, below the direct path), 1 MiB (direct). In poison mode: a
# precv that leaves its output unwritten writes poison there, which shows in the result
# where a select is missing (the buffer may hold an earlier fill's zeros otherwise).
with config.overrides(poison_uninitialized=True):
    for form in ("combined", "selected", "carried"):
        for nbytes in (8, 64 << 10, 1 << 20):
            check(f"two-op exchange in a scan, {form}, {nbytes} B",
                  cases.two_op_exchange_in_scan(cross, gather, count=nbytes // 4, form=form))
if LARGE:
    # Chunked, just above its threshold, as the ring above: what a larger exchange adds, a
    # fresh map (32 MiB), the one-way case at the end has, and a message too large for TCP's
    # buffers the late receivers' (32 MiB too).
    check("two-way 4 MiB + 12 B exchange, sends first",
          cases.two_way_exchange(cross, unmoved, nbytes=(4 << 20) + 12))
    # The two-op exchange in a scan, 4 MiB + 4 KiB + 12 B and 9 MiB + 12 B per message: a
    # precv that is no destination and fills (the first step's, before the loop, in the
    # carried form) gives its output's whole huge pages back and writes the rest; three calls
    # each. Both fail with the head and tail left unwritten, or with the pages neither given
    # back nor written. In poison mode too, as above.
    with config.overrides(poison_uninitialized=True):
        for form, nbytes in (("carried", (4 << 20) + 4108), ("combined", (9 << 20) + 12)):
            check(f"two-op exchange in a scan, {form}, {nbytes} B",
                  cases.two_op_exchange_in_scan(cross, gather, count=nbytes // 4, form=form))
    # Each direction's large send staged for a late receiver, its sender's program done before
    # the message has moved (only the progress thread then moves it: over TCP, and over UCX's
    # shared memory on one node too).
    for late in (1, 0):
        check(f"32 MiB to a late receiver (device {late}), 8 B back",
              cases.late_receiver_exchange(cross, gather, late=late))
    # One way at a fresh map's size (32 MiB + 4 KiB + 12 B, cpp/local/zero_fill.h): device 0 is
    # no destination, and its zeros leave the untouched pages of its output alone. Checked
    # against NumPy (under mpirun ppermute takes this same path), in three calls: a later
    # call's output may be pages that an earlier call touched and freed.
    big = (32 << 18) + 1027
    value = cases.sample((2 * big,), np.float32, seed=5)
    one_way = jax.jit(jax.shard_map(lambda v: cases.sendrecv(v, "x", [(0, 1)]), mesh=cross,
                                    in_specs=jax.sharding.PartitionSpec("x"),
                                    out_specs=jax.sharding.PartitionSpec("x")))
    for call in range(3):
        got = one_way(cases.put(cross, jax.sharding.PartitionSpec("x"), value))
        check(f"one way at 32 MiB + 4 KiB + 12 B, zeros on device 0, call {call}",
              (got, np.concatenate([np.zeros(big, np.float32), value[:big]])))
        del got  # freed before the next call, which may then get its pages


def long_wait(delay_s: float = 0.5) -> dict:
    """Device 1 of ``cross`` waits ``delay_s`` in its precv for 8 B that device 0 sends
    after a host callback's sleep: this rank's wait sleeps (stats) over the call, and the
    call's seconds. A wait that long is a peer computing; its sleeps grow past 50 us."""
    import time

    import jax_cpu_mpi

    def late(index, x):
        if int(index) == 0:
            time.sleep(delay_s)
        return x

    def body(x):
        index = jax.lax.axis_index("x")
        x = jax.pure_callback(late, jax.ShapeDtypeStruct(x.shape, x.dtype), index, x)
        token = jax_cpu_mpi.psend(x, "x", [(0, 1)])
        return jax_cpu_mpi.precv(token, jax.ShapeDtypeStruct(x.shape, x.dtype), "x", [(0, 1)])

    spec = jax.sharding.PartitionSpec("x")
    f = jax.jit(jax.shard_map(body, mesh=cross, in_specs=spec, out_specs=spec,
                              check_vma=False))
    x = jax.make_array_from_callback((4,), jax.sharding.NamedSharding(cross, spec),
                                     lambda i: np.arange(4, dtype=np.float32)[i])
    jax.block_until_ready(f(x))  # compiled, and both ranks past it
    before = jax_cpu_mpi_stats()["wait_sleeps"]
    start = time.perf_counter()
    got = gather(f(x))
    seconds = time.perf_counter() - start
    np.testing.assert_array_equal(got, np.asarray([0, 0, 0, 1], np.float32))
    return {"sleeps": jax_cpu_mpi_stats()["wait_sleeps"] - before, "seconds": seconds,
            "receiver": cross.devices.flat[1].process_index == jax.process_index()}


print("longwait " + json.dumps(long_wait()), flush=True)

# How the transport chose to wait, with what this rank sees, for the test to check.
print("wait " + json.dumps({"chosen": ext.mpi_wait(), "affinity": len(os.sched_getaffinity(0)),
                            "local_devices": jax.local_device_count()}), flush=True)
# What this rank's waits for its peer did so far (the late receivers above waited).
stats = jax_cpu_mpi_stats()
print("waits " + json.dumps({k: stats[k] for k in ("wait_yields", "wait_sleeps")}), flush=True)



def faults_of_a_second_64_mib_block() -> int:
    """Minor page faults of filling a 64 MiB block right after one was freed: glibc's
    default maps a block this large afresh (every page faulted in again); with
    JAX_CPU_MPI_KEEP_FREED_MEMORY the heap keeps the freed one and serves it again."""
    np.ones(64 << 20, np.uint8)  # allocated, filled and freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    np.ones(64 << 20, np.uint8)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


print("malloc " + json.dumps({"faults": faults_of_a_second_64_mib_block()}), flush=True)

if failures:
    print("FAILED:", failures, flush=True)
    sys.exit(1)
common.ok()
