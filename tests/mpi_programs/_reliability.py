"""Helpers of the reliability programs: a position-dependent byte pattern and memory probes."""

from __future__ import annotations

import resource

import jax.numpy as jnp
import numpy as np
from jax import lax

_GOLDEN = 2654435761  # Knuth's multiplicative hash: every byte depends on its position


def pattern(rows: int, cols: int, salt=0, row0=0) -> jnp.ndarray:
    """uint8[rows, cols], rows ``row0..row0+rows-1`` of a pattern whose byte ``k`` (row-major)
    is the top byte of ``k * 2654435761 mod 2**32`` plus ``salt``: a shifted, truncated or
    reordered copy does not match it."""
    r = lax.broadcasted_iota(jnp.uint32, (rows, cols), 0) + jnp.asarray(row0, jnp.uint32)
    c = lax.broadcasted_iota(jnp.uint32, (rows, cols), 1)
    h = (r * jnp.uint32(cols) + c) * jnp.uint32(_GOLDEN)
    return (h >> 24).astype(jnp.uint8) + jnp.asarray(salt, jnp.uint8)


def pattern_np(rows: slice, cols: int, salt: int = 0) -> np.ndarray:
    """The rows ``rows`` of :func:`pattern`, computed with NumPy."""
    r = np.arange(rows.start, rows.stop, dtype=np.uint64)[:, None]
    c = np.arange(cols, dtype=np.uint64)[None, :]
    h = ((r * cols + c) * _GOLDEN) % (1 << 32)
    return ((h >> 24).astype(np.uint8) + np.uint8(salt)).astype(np.uint8)


def count_bad_rows(y: jnp.ndarray, salt: int, block_rows: int = 4096) -> jnp.ndarray:
    """How many rows of ``y`` differ from ``pattern(*y.shape, salt)``, block by block so that
    no temporary as large as ``y`` is made (rows of a clamped last block count twice)."""
    rows, cols = y.shape
    block_rows = min(block_rows, rows)

    def block(i, bad):
        start = jnp.minimum(i * block_rows, rows - block_rows)
        got = lax.dynamic_slice_in_dim(y, start, block_rows, axis=0)
        want = pattern(block_rows, cols, salt, start)
        return bad + jnp.sum(jnp.any(got != want, axis=1).astype(jnp.int32))

    return lax.fori_loop(0, -(-rows // block_rows), block, jnp.int32(0))


def rss_bytes() -> int:
    """Resident memory of this process now (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (ru_maxrss)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
