"""GPU parity over MPI: every 2-device scenario of parity_cases, one device per rank.

Rejected programs must fail in ``.lower()`` on every rank with the same message, before
anything runs; accepted programs must give the reference values.
"""

import re
import zlib

import _mpi_common as common
import jax
import numpy as np
import parity_cases as cases
from jax.experimental import multihost_utils

import jax_cpu_mpi
from jax_cpu_mpi import config
from jax_cpu_mpi._src.parity import check as validation

assert jax.device_count() == 2, jax.devices()
mesh = jax.make_mesh((2,), ("x",))
x = cases.put(mesh, cases.ROWS, cases.rows(2))


def same_on_every_rank(text: str) -> None:
    digest = np.array([zlib.crc32(text.encode())], np.uint32)
    digests = multihost_utils.process_allgather(digest)
    assert len(set(np.asarray(digests).ravel().tolist())) == 1, (text, digests)


for name, case in sorted(cases.REJECTED.items()):
    f = cases.program(mesh, case.fn)
    before = jax_cpu_mpi.stats()
    for attempt in ("lower", "call"):
        try:
            f.lower(x) if attempt == "lower" else f(x)
        except case.error as e:
            message, error = str(e), e
        else:
            raise AssertionError(f"{name}: {attempt} did not raise {case.error.__name__}")
        assert re.search(case.message, message), (name, message)
        if case.error is not ValueError:
            assert isinstance(error, validation.GpuParityError), (name, type(error))
    assert jax_cpu_mpi.stats() == before, (name, before, jax_cpu_mpi.stats())
    same_on_every_rank(message)
    print(f"rejected at lowering: {name}", flush=True)

got, want, expected = cases.accepted_chain_then_back_edge(mesh, common.gather)
np.testing.assert_allclose(got, want, rtol=1e-6)
np.testing.assert_allclose(got, expected, rtol=1e-6)

# issue 12: accepted because XLA's verifier sees each precv right after its psend.
big = 8 * 1024 * 1024  # 32 MiB of float32 each way
got, expected = cases.accepted_two_sends_then_two_precvs(mesh, common.gather, big)
np.testing.assert_array_equal(got, expected)
assert got.shape == (2, 2 * big)
print("two psends then two precvs: 32 MiB each way, values right", flush=True)

got, want = cases.accepted_opposite_order(mesh, common.gather)
np.testing.assert_array_equal(got, want)
got, want = cases.accepted_ppermute_between_in_program_order(mesh, common.gather)
np.testing.assert_array_equal(got, want)

got, want = cases.accepted_precv_before_psend(mesh, common.gather)
np.testing.assert_array_equal(got, want)

(out, fwd), (want_out, want_fwd) = cases.accepted_pipeline(mesh, common.gather)
np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(fwd, want_fwd, rtol=1e-5, atol=1e-6)
assert np.abs(want_out[1]).min() > 0

with config.overrides(gpu_parity=False):
    got = common.gather(cases.program(mesh, cases.REJECTED["cycle"].fn)(x))
np.testing.assert_array_equal(got, cases.rows(2)[::-1])
print("accepted programs match their references", flush=True)

common.ok()
