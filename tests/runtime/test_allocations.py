"""psend and precv make no heap allocation of their own per message (issue 37).

Counted by benchmarks/malloc_count.c (LD_PRELOAD) in benchmarks/alloc_counts.py: the
difference between two run lengths of the same program, per psend and precv of a process.
Before the per-channel reuse of the send's record, header, copies and ready signals (and
KeptSends without a std::function and map node per send) a step made 4 allocations at 8 B
and 12 at 64 KiB and 1 MiB; what is left is MPICH's own (2 a message from 16 KiB on).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mpi_launcher import run_mpi

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parents[2]

#: The most allocations a psend and a precv may make together per step, by (pattern, size):
#: MPICH's own 2 per framed or rendezvous message, and a little slack for the rounding
#: of a loaded machine's counts (the lowest of the rounds is taken; a rendezvous of a
#: cycle that a late receiver turns into a staged copy counts a little more).
LIMITS = {
    ("hop", 8): 0.5,
    ("exchange", 8): 0.5,
    ("hop", 65536): 2.5,
    ("exchange", 65536): 2.5,
    ("hop", 1 << 20): 2.5,
    ("exchange", 1 << 20): 3.5,
    # A framed hop, then an 8-byte one on the same channel, each way: the 8-byte message goes
    # staged as a chunk header and its chunk (the channel's last header lets framed payloads
    # go bare). Its header was a new Envelope per message, its requests a growing list and a
    # pending entry, its copy never the channel's spare: 5 a step before they were reused.
    ("mixed", 8): 0.5,
    ("mixed", 65536): 3.5,
    ("mixed", 1 << 20): 3.5,
}


@pytest.mark.timeout(300)
def test_psend_and_precv_allocate_nothing_per_message(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the allocation counter")
    counter = tmp_path / "malloc_count.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(counter),
                    str(ROOT / "benchmarks" / "malloc_count.c")], check=True)
    run = run_mpi(str(ROOT / "benchmarks" / "alloc_counts.py"), "--sizes", "8,64K,1M",
                  "--kinds", "hop,exchange,mixed", "--short", "8", "--long", "40", "--calls", "3",
                  "--rounds", "3", timeout=240, env={"LD_PRELOAD": str(counter)})
    assert run.returncode == 0, run.report()
    found = {}
    for line in run.rank_output.get(0, "").splitlines():
        m = re.match(r"rank (\d) (\w+) (\d+) B: per psend \+ precv: allocations ([-\d.]+)", line)
        if m:
            found[(int(m[1]), m[2], int(m[3]))] = float(m[4])
    assert len(found) == 2 * len(LIMITS), run.rank_output.get(0, "")
    over = {k: v for k, v in found.items() if v > LIMITS[k[1:]]}
    assert not over, f"allocations per psend + precv over the limit: {over}"
