"""psend/precv between the virtual CPU devices of one process (no MPI).

Values are compared with lax.ppermute on the same input or with numpy simulations.
"""

from __future__ import annotations

import mmap
import os

import jax
import jax.numpy as jnp
import numpy as np
import p2p_cases as cases
import pytest
from jax.sharding import PartitionSpec as P

import jax_cpu_mpi
from conftest import make_mesh
from jax_cpu_mpi import _jax_cpu_mpi as ext
from jax_cpu_mpi import config


@pytest.fixture(autouse=True)
def transport_semantics():
    """These tests pin the transport's semantics, cyclic pairs in one op included, which XLA
    GPU rejects at compile time (tests/parity/test_gpu_parity.py covers that): parity off here,
    except where a test turns it back on."""
    with config.overrides(gpu_parity=False):
        yield


def gather(x: jax.Array) -> np.ndarray:
    return np.asarray(x)


def assert_equal(pair):
    got, want = pair
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("kind", ["ring", "reverse_ring", "partial", "single_pair", "shift2"])
def test_matches_ppermute(n, kind):
    perms = {
        "ring": [(i, (i + 1) % n) for i in range(n)],
        "reverse_ring": [((i + 1) % n, i) for i in range(n)],
        # Devices that are no destination get zeros; devices that are no source send nothing.
        "partial": [(i, i + 1) for i in range(0, n - 1, 2)],
        "single_pair": [(n - 1, 0)],
        "shift2": [(i, (i + 2) % n) for i in range(n)],
    }
    mesh = make_mesh((n, "x"))
    got, want = cases.permute_vs_ppermute(mesh, gather, axis="x", perm=perms[kind])
    assert_equal((got, want))
    if kind == "partial":
        assert not got.reshape(n, -1)[0].any(), "device 0 is no destination: zeros"


@pytest.mark.parametrize("dtype", cases.ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype(dtype):
    jax.config.update("jax_enable_x64", True)
    try:
        mesh = make_mesh((4, "x"))
        perm = [(0, 2), (2, 1), (1, 3)]
        assert_equal(cases.permute_vs_ppermute(mesh, gather, axis="x", perm=perm, dtype=dtype,
                                               block=(2, 3)))
        assert_equal(cases.scalar_blocks(mesh, gather, dtype=dtype))
    finally:
        jax.config.update("jax_enable_x64", False)


def test_empty_array():
    mesh = make_mesh((2, "x"))
    x = jax.device_put(jnp.zeros((2, 0), jnp.float32),
                       jax.sharding.NamedSharding(mesh, P("x")))
    f = jax.jit(jax.shard_map(lambda v: cases.sendrecv(v, "x", [(0, 1)]), mesh=mesh,
                              in_specs=P("x"), out_specs=P("x")))
    assert f(x).shape == (2, 0)


def _jax_refuses_axes_out_of_mesh_order() -> bool:
    """JAX >= 0.12: ppermute (and psend/precv, which share its lowering helper) raise when
    the axis names are not in mesh order (``jax_raise_on_ppermute_sort_diff``, default on);
    earlier versions sort the device groups."""
    return bool(jax.config.values.get("jax_raise_on_ppermute_sort_diff", False))


def _check_2d_mesh_axes(mesh, axis, size):
    perms = [[(i, (i + 1) % size) for i in range(size)], [(size - 1, 0), (0, size // 2)]]
    for perm in perms:
        got, want = cases.permute_vs_ppermute(mesh, gather, axis=axis, perm=perm,
                                              spec=P(("x", "y")))
        assert_equal((got, want))
        assert got.any()


@pytest.mark.parametrize("axis", ["x", "y", ("x", "y"), ("y", "x")])
def test_2d_mesh_axes(axis):
    mesh = make_mesh((2, "x"), (4, "y"))
    size = 8 if isinstance(axis, tuple) else mesh.shape[axis]
    if axis == ("y", "x") and _jax_refuses_axes_out_of_mesh_order():
        # JAX's own error, from the same helper the GPU lowering uses: as on GPU.
        perm = [(i, (i + 1) % size) for i in range(size)]
        x = cases.put(mesh, P(("x", "y")), cases.sample((3 * size,), np.float32))
        for body in (lambda v: cases.sendrecv(v, axis, perm),
                     lambda v: jax.lax.ppermute(v, axis, perm)):
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("x", "y")),
                                      out_specs=P(("x", "y"))))
            with pytest.raises(RuntimeError, match="same order as the axis_names declared"):
                f.lower(x)
        # With JAX's check off, psend/precv and ppermute agree again (unsorted groups).
        jax.config.update("jax_raise_on_ppermute_sort_diff", False)
        try:
            _check_2d_mesh_axes(mesh, axis, size)
        finally:
            jax.config.update("jax_raise_on_ppermute_sort_diff", True)
        return
    _check_2d_mesh_axes(mesh, axis, size)


@pytest.mark.parametrize("kind", ["scan", "fori_loop", "while_loop", "cond"])
def test_control_flow(kind):
    assert_equal(cases.loop_hops(make_mesh((4, "x")), gather, kind=kind))


@pytest.mark.parametrize("n", [2, 4])
def test_manual_pipeline_pattern(n):
    with config.overrides(gpu_parity=True):  # the GPU accepts this pattern: so must we
        got, want = cases.manual_pipeline(make_mesh((n, "x")), gather)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("counts", [(2, 2), (1 << 18, 3), (3, 1 << 18), (1 << 18, 1 << 19)],
                         ids=["small-small", "large-small", "small-large", "large-large"])
def test_fifo_on_one_pair(counts):
    assert_equal(cases.fifo_same_pair(make_mesh((4, "x")), gather, counts=counts))


def test_send_compute_send_back():
    with config.overrides(gpu_parity=True):
        pair = cases.send_compute_send_back(make_mesh((2, "x")), gather)
    np.testing.assert_allclose(*pair, rtol=1e-6)


def test_two_way_32mib_exchange_does_not_deadlock():
    # Both psends before both precvs, 32 MiB each (XLA GPU rejects this program: two sends in
    # a row whose pairs form a cycle; the transport must still never deadlock on it).
    assert_equal(cases.two_way_exchange(make_mesh((2, "x")), gather))
    assert jax_cpu_mpi.stats()["mailbox_queued_messages"] == 0


def test_token_orders_precv_after_psend():
    """precv's custom call consumes the token that psend's custom call returns."""
    mesh = make_mesh((2, "x"))
    f = jax.jit(jax.shard_map(lambda v: cases.sendrecv(v, "x", [(0, 1)]), mesh=mesh,
                              in_specs=P("x"), out_specs=P("x")))
    x = jax.device_put(jnp.ones(4), jax.sharding.NamedSharding(mesh, P("x")))
    hlo = f.lower(x).compile().as_text()
    send = [line for line in hlo.splitlines() if "jax_cpu_mpi_psend" in line]
    recv = [line for line in hlo.splitlines() if "jax_cpu_mpi_precv" in line]
    assert len(send) == 1 and len(recv) == 1, hlo
    send_name = send[0].split("=")[0].strip().lstrip("%").split()[-1]
    # psend returns (token, u32 zero): the precv's first operand is the token, element 0.
    assert "(token[], u32[])" in send[0].split("=")[1].split("custom-call")[0], send[0]
    token = [line for line in hlo.splitlines()
             if f"get-tuple-element(%{send_name}), index=0" in line]
    assert len(token) == 1, hlo
    token_name = token[0].split("=")[0].strip().lstrip("%").split()[-1]
    first_operand = recv[0].split("custom-call(")[1].split(",")[0].strip()
    assert first_operand == f"%{token_name}", (token[0], recv[0])


def test_dropped_token_still_sends():
    """A psend whose token is unused is side-effecting: it is not dead-code eliminated."""
    mesh = make_mesh((2, "x"))

    def body(v):
        jax_cpu_mpi.psend(v, "x", [(0, 1)])
        return jax_cpu_mpi.precv(jax.lax.create_token(), jax.ShapeDtypeStruct(v.shape, v.dtype),
                                 "x", [(0, 1)])

    x = jax.device_put(jnp.arange(4.0), jax.sharding.NamedSharding(mesh, P("x")))
    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)
    np.testing.assert_array_equal(got, [0, 0, 0, 1])


def test_programs_on_disjoint_devices_do_not_mix():
    """Two programs on different devices use different channels even for equal partition ids."""
    mesh_a = jax.make_mesh((2,), ("x",), devices=jax.devices()[0:2])
    mesh_b = jax.make_mesh((2,), ("x",), devices=jax.devices()[2:4])
    outs = []
    for mesh, base in ((mesh_a, 0.0), (mesh_b, 100.0)):
        x = jax.device_put(jnp.arange(4.0) + base, jax.sharding.NamedSharding(mesh, P("x")))
        f = jax.jit(jax.shard_map(lambda v: cases.sendrecv(v, "x", [(0, 1), (1, 0)]), mesh=mesh,
                                  in_specs=P("x"), out_specs=P("x")))
        outs.append(f(x))
    np.testing.assert_array_equal(outs[0], [2, 3, 0, 1])
    np.testing.assert_array_equal(outs[1], [102, 103, 100, 101])


def test_zero_fill_writes_exactly_its_buffer():
    """The zeros of a precv that is no destination: streaming stores from a cache-sized
    threshold (cpp/local/zero_fill.h), memset below it. Every byte of the buffer, at every
    alignment, and none around it."""
    streaming = ext.streaming_zero_fill_min_bytes()
    assert streaming == 0 or streaming >= 1 << 20, streaming  # 0: not on this platform
    sizes = [1, 63, 4096 + 5] + ([streaming - 1, streaming, streaming + 61] if streaming else [])
    for n in sizes:
        for offset in (0, 1, 17, 63):
            buffer = np.full(n + 128, 0xAB, np.uint8)
            ext.zero_fill(buffer[offset:offset + n])
            assert not buffer[offset:offset + n].any(), (n, offset)
            assert (buffer[:offset] == 0xAB).all() and (buffer[offset + n:] == 0xAB).all(), (
                n, offset)


#: ZeroFill leaves untouched pages alone from this size (kFreshMapMinBytes, cpp/common).
FRESH_MAP_BYTES = 32 << 20


def _present_pages(array: np.ndarray) -> int:
    """Pages of ``array`` that this process has in memory (/proc/self/pagemap bit 63)."""
    page = mmap.PAGESIZE
    start = array.ctypes.data
    first, last = start // page, (start + array.nbytes + page - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first) * 8), np.uint64)
    return int(np.count_nonzero(entries >> np.uint64(63)))


def _mapped(n: int, flags: int, fileno: int = -1) -> tuple[mmap.mmap, np.ndarray]:
    m = mmap.mmap(fileno, n, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return m, np.frombuffer(m, np.uint8)


@pytest.mark.skipif(not os.access("/proc/self/pagemap", os.R_OK),
                    reason="no /proc/self/pagemap (not Linux): ZeroFill writes every page")
def test_zero_fill_leaves_untouched_anonymous_pages_alone(tmp_path):
    """A large output that is a fresh map reads as zeros already: ZeroFill writes only the
    pages that were touched (fails if it writes every page: all present after), and zeros
    every byte whatever the mapping: a private map of a file (its untouched pages read the
    file: fails if they are skipped as anonymous), a shared one, a partly touched one."""
    n = FRESH_MAP_BYTES + 3 * mmap.PAGESIZE
    page = mmap.PAGESIZE
    anonymous = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    m, fresh = _mapped(n, anonymous)
    ext.zero_fill(fresh[5:])  # not page-aligned: the partial first page is written
    # Before reading maps them. At most the first and last pages were written, each of which
    # may fault in a whole huge page where the kernel's THP setting is "always".
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            huge = int(f.read())
    except (OSError, ValueError):
        huge = 2 << 20
    written = _present_pages(fresh)
    assert written <= 2 * max(huge // page, 1) < n // page // 4, (written, n // page)
    assert not fresh.any()
    del fresh
    m.close()

    m, partly = _mapped(n, anonymous)
    partly[::3 * page] = 0xFF  # every third page touched
    touched = _present_pages(partly)
    ext.zero_fill(partly)
    # Never more pages than were touched (fewer where the whole huge pages were given back).
    assert _present_pages(partly) <= touched
    assert not partly.any()
    del partly
    m.close()

    path = tmp_path / "pattern"
    path.write_bytes(b"\xab" * n)
    with open(path, "r+b") as f:
        for flags in (mmap.MAP_PRIVATE, mmap.MAP_SHARED):
            m, filed = _mapped(n, flags, f.fileno())
            # Every other page written first: a private map then holds copies of them, which
            # given back to the kernel would read the file again (fails if they are dropped).
            filed[::2 * page] = 0xCD
            ext.zero_fill(filed)
            assert not filed.any(), flags
            del filed
            m.close()
    m, shared = _mapped(n, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    shared[::page] = 7
    ext.zero_fill(shared)
    assert not shared.any()
    del shared
    m.close()


def _huge_pages() -> int:
    """4 KiB pages in a transparent huge page."""
    with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
        return int(f.read()) // mmap.PAGESIZE


@pytest.mark.skipif(not ext.zero_fill_drop_min_bytes() or
                    not os.access("/proc/self/pagemap", os.R_OK),
                    reason="no transparent huge pages here: ZeroFill writes every page")
def test_zero_fill_gives_whole_huge_pages_back():
    """From zero_fill_drop_min_bytes a buffer's whole huge pages are given back to the
    kernel (MADV_DONTNEED) instead of written: they read as zeros and are no longer in
    memory (fails if every page is written). The bytes around the buffer keep their values,
    the buffer's partial huge pages at both ends are written, and the buffer written again
    afterwards holds what was written (the pages fault back in), then zeros again."""
    n = 4 * ext.zero_fill_drop_min_bytes() + 3 * mmap.PAGESIZE + 5
    huge_pages = _huge_pages()
    backing = np.full(n + 200, 0xAB, np.uint8)  # every page present
    buffer = backing[100:-100]
    for value in (0x11, 0x22):
        ext.zero_fill(buffer)
        present = _present_pages(buffer)  # before reading, which maps the zero page
        assert present <= 2 * huge_pages + 2 < n // mmap.PAGESIZE // 2, (present, n)
        assert not buffer.any()
        assert (backing[:100] == 0xAB).all() and (backing[-100:] == 0xAB).all()
        buffer[:] = value
        assert (buffer == value).all()
    # Below the threshold every byte is written, whatever the pages.
    small = backing[100:100 + ext.zero_fill_drop_min_bytes() - 1]
    ext.zero_fill(small)
    assert not small.any() and (backing[:100] == 0xAB).all()
    assert backing[100 + small.size] == 0x22


@pytest.mark.skipif(not ext.zero_fill_drop_min_bytes() or
                    not os.access("/proc/self/pagemap", os.R_OK),
                    reason="no transparent huge pages here: ZeroFill writes every page")
def test_zero_fill_gives_the_ends_absent_pages_back():
    """At the partial huge pages at both ends of a buffer from zero_fill_drop_min_bytes, the
    4 KiB pages not in memory (a fresh output's) are given back, not written (fails if they
    are written, as before: they would be in memory after, each one a page fault), and those
    in memory are written; the whole huge pages are given back, in memory or not. Every byte
    reads zero, the bytes around keep their values, and the stats count what was written and
    given back."""
    page = mmap.PAGESIZE
    huge = _huge_pages() * page
    n = 4 * ext.zero_fill_drop_min_bytes() + 3 * page + 5
    m, backing = _mapped(n + 2 * huge + 2 * page, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The buffer starts 5 bytes into a page, a few pages past a huge page's boundary: its
    # ends are partial huge pages.
    base = backing.ctypes.data
    offset = (-base) % huge + 3 * page + 5
    buffer = backing[offset:offset + n]
    backing[:] = 0xAB  # every page present
    first_huge = offset + (-(base + offset)) % huge
    whole = (offset + n - first_huge) // huge * huge
    # Not in memory before the fill: the second whole huge page, two 4 KiB pages at each end.
    m.madvise(mmap.MADV_DONTNEED, first_huge + huge, huge)
    m.madvise(mmap.MADV_DONTNEED, offset - 5 + page, 2 * page)
    last_whole = (offset + n) // page * page
    m.madvise(mmap.MADV_DONTNEED, last_whole - 2 * page, 2 * page)
    before = _present_pages(buffer)
    s0 = ext.stats()
    ext.zero_fill(buffer)
    s1 = ext.stats()
    written = s1["zero_fill_written_bytes"] - s0["zero_fill_written_bytes"]
    dropped = s1["zero_fill_dropped_bytes"] - s0["zero_fill_dropped_bytes"]
    given_back = whole + 4 * page
    assert dropped == given_back and written == n - given_back, (dropped, written, n)
    after = _present_pages(buffer)
    assert after == before - (whole - huge) // page, (after, before)
    assert not buffer.any()
    assert (backing[:offset] == 0xAB).all() and (backing[offset + n:] == 0xAB).all()
    del buffer, backing
    m.close()


@pytest.mark.parametrize("kind", ["streamed", "fresh-map"])
def test_large_zeros_over_a_reused_buffer_match_ppermute(kind):
    """A streamed zero-fill (a message of the threshold's size and more), and one large
    enough to skip a fresh map's untouched pages (FRESH_MAP_BYTES), into a buffer XLA
    reuses within the loop: there the precv of device 0 (no destination) writes where
    another precv's data was (present pages, which must be written), and into the call's
    fresh outputs. Equal to ppermute's values; fails if the zeros are not written (checked
    with a zero-fill that skips large buffers)."""
    if kind == "streamed":
        elements = (ext.streaming_zero_fill_min_bytes() or 8 << 20) // 4 + 16
    else:
        elements = FRESH_MAP_BYTES // 4 + 1024 + 3
    mesh = make_mesh((2, "x"))

    def program(hop):
        def step(c, _):
            a = hop(c, [(1, 0)])  # device 0 receives data
            return hop(a * 2.0 + 1.0, [(0, 1)]) + 1.0, None  # device 0: zeros, over a's

        return jax.jit(jax.shard_map(lambda v: jax.lax.scan(step, v, None, length=3)[0],
                                     mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                     check_vma=False))

    x = jax.device_put(jnp.arange(2 * elements, dtype=jnp.float32) % 7,
                       jax.sharding.NamedSharding(mesh, P("x")))
    want = np.asarray(program(lambda c, perm: jax.lax.ppermute(c, "x", perm))(x))
    ours = program(lambda c, perm: cases.sendrecv(c, "x", perm))
    for _ in range(2):
        got = np.asarray(ours(x))
        # np.array_equal first: assert_array_equal is many times slower on arrays of the
        # streaming threshold's size (hundreds of MiB); it still writes the failure message.
        if not np.array_equal(got, want):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("count", [2, 1 << 17], ids=["8B", "512KiB"])
def test_pytree_leaves_arrive_in_their_own_places(count):
    # Two psends of the same pairs in flight: XLA GPU's deadlock check rejects the program.
    with config.overrides(gpu_parity=False):
        for _ in range(3):  # the order XLA picks may vary from run to run
            assert_equal(cases.pytree_leaves_in_place(make_mesh((4, "x")), gather,
                                                      count=count))



def test_partially_manual_shard_map_is_refused_at_lowering():
    # XLA's SPMD partitioner refuses the partition id our calls route by there: a clear
    # error at lowering, naming the op and the axes, instead of XLA's RET_CHECK at compile.
    mesh = make_mesh((2, "x"), (2, "y"))
    f = jax.jit(jax.shard_map(lambda a: cases.sendrecv(a, "x", [(0, 1)]), mesh=mesh,
                              in_specs=P("x"), out_specs=P("x"), axis_names={"x"}))
    x = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(mesh, P("x")))
    with pytest.raises(NotImplementedError, match=r"psend\(axis_name=\('x',\)\) is inside a "
                       r"partially manual shard_map \(manual axes \('x',\) of the mesh's "
                       r"\('x', 'y'\)\).*jax.lax.ppermute"):
        f(x)
