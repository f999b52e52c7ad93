"""jax_cpu_mpi on a JAX that has dropped psend/precv (simulated in subprocesses).

JAX 0.12 deprecates ``jax.lax.psend``/``precv``; a later JAX removes them with their
primitives. Each test here starts a subprocess with ``JCM_TEST_JAX_WITHOUT_P2P=1``: before
jax_cpu_mpi is imported, JAX's ``psend``/``precv`` functions and ``psend_p``/``precv_p``
primitives are deleted (``mpi_programs/jax_p2p_removal.py``; every mpirun rank and every
Python subprocess of those tests does the same), so jax_cpu_mpi defines and lowers its own.
The subprocesses rerun parts of this suite that way: the p2p scenarios in one process and
under ``mpirun -n 2`` (2 devices per rank), the batching rules, the GPU-parity rejections
and the pipeline example; and the GPU lowering of our own primitives is compared with what
JAX's lowering produced for the same programs in this process.

The parts that need no mpirun share ONE pytest subprocess (:func:`simulated_suite`; each
part's test asserts on its own files' results, read from the run's JUnit XML report), as
a subprocess costs an interpreter, ``import jax`` and the suite's setup.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import p2p_programs as programs
import pytest
from jax_p2p_removal import ENV

from conftest import needs_jax_p2p, newest_jax_only

ROOT = Path(__file__).resolve().parents[2]
REMOVAL = Path(__file__).parents[1] / "mpi_programs" / "jax_p2p_removal.py"


def _env(what: str = "1") -> dict[str, str]:
    env = dict(os.environ, **{ENV: what})
    env.pop("XLA_FLAGS", None)  # conftest / the programs set their own device counts
    return env


@dataclass
class SuiteRun:
    """A pytest subprocess without JAX's psend/precv: its exit code, output and the outcome
    (passed, failed, error, skipped) of each test, by ``(module, test name)``."""

    returncode: int
    output: str
    outcomes: dict[tuple[str, str], list[str]]

    def counts(self, *targets: str) -> dict[str, int]:
        """The outcomes of the tests of ``targets`` (``FILE`` or ``FILE::TEST``), which must
        have run without JAX's primitives, and without a failure or an error."""
        assert "jax_cpu_mpi primitives: jax_cpu_mpi" in self.output, self.output[-5000:]
        # 0: all passed; 1: some test failed (maybe of another part). Anything else
        # (interrupted, a collection error, an internal error, no tests) fails every part.
        assert self.returncode in (0, 1), self.output[-20000:]
        counts: collections.Counter[str] = collections.Counter()
        for target in targets:
            file, _, test = target.partition("::")
            module = file.removesuffix(".py").replace("/", ".")
            for (classname, name), outcomes in self.outcomes.items():
                if classname != module and not classname.startswith(module + "."):
                    continue
                if test and name != test and not name.startswith(test + "["):
                    continue
                counts.update(outcomes)
        assert counts.get("failed", 0) == 0 and counts.get("error", 0) == 0, (
            dict(counts), self.output[-20000:])
        return dict(counts)


def _outcomes(report: Path) -> dict[tuple[str, str], list[str]]:
    outcomes: dict[tuple[str, str], list[str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        # A test that passed but whose teardown failed has both: count each.
        outcome = [{"failure": "failed"}.get(k, k) for k in kinds] or ["passed"]
        key = (case.get("classname", ""), case.get("name", ""))
        outcomes.setdefault(key, []).extend(outcome)
    return outcomes


def run_suite_part(*targets: str, marks: str | None = None, timeout: float,
                   what: str = "1", deselect: tuple[str, ...] = (),
                   env: dict[str, str] | None = None) -> SuiteRun:
    """Run pytest on ``targets`` in a subprocess without JAX's psend/precv (``what``:
    ``effect`` removes their effect too), less the tests whose ids start with one of
    ``deselect``, with ``env`` added to its environment."""
    with tempfile.TemporaryDirectory(prefix="jcm-without-p2p-") as tmp:
        report = Path(tmp) / "report.xml"
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs",
                   f"--junitxml={report}", *(["-m", marks] if marks else []),
                   *(f"--deselect={d}" for d in deselect), *targets]
        proc = subprocess.run(command, cwd=ROOT, env={**_env(what), **(env or {})},
                              capture_output=True, text=True, timeout=timeout)
        output = proc.stdout + proc.stderr
        assert report.exists(), output[-20000:]
        return SuiteRun(proc.returncode, output, _outcomes(report))


#: The parts of the suite rerun without JAX's psend/precv in one process.
P2P_IN_ONE_PROCESS = ("tests/lowering/test_p2p_single_process.py",
                      "tests/lowering/test_p2p_errors.py", "tests/ops/test_p2p_api.py",
                      "tests/test_smoke.py")
BATCHING = ("tests/batching/test_batching.py",)
GPU_PARITY = ("tests/parity/test_gpu_parity.py",)
PIPELINE_ONE_PROCESS = (
    "tests/test_pipeline_example.py::test_one_process_four_devices_matches_reference",)
#: Tests of P2P_IN_ONE_PROCESS that the simulation does not rerun: large messages and the
#: zero fill, whose programs differ from the kept tests' in sizes only, which reach the
#: extension's handlers alone. The CPU lowering rule is the same whoever's primitive was
#: bound (lowering/rules.py), so those handlers get the same custom calls in both
#: simulations; the suite's own run of these tests covers them. What the simulation is
#: for (binding, abstract evaluation, effects, the order of a pytree's leaves) does not
#: depend on sizes, and the kept tests reach it: the 8 B pytree, the FIFO cases, the loops.
SIZES_ONLY = tuple(f"tests/lowering/test_p2p_single_process.py::{t}" for t in (
    "test_two_way_32mib_exchange_does_not_deadlock", "test_zero_fill_",
    "test_large_zeros_over_a_reused_buffer_match_ppermute",
    "test_pytree_leaves_arrive_in_their_own_places[512KiB]"))


@pytest.fixture(scope="module")
def simulated_suite() -> SuiteRun:
    """One pytest subprocess for every part that needs no mpirun (the tests below read their
    own part of it). Its time counts towards the first test that asks for it, hence their
    timeouts: each is the whole run's."""
    return run_suite_part(*P2P_IN_ONE_PROCESS, *BATCHING, *GPU_PARITY, *PIPELINE_ONE_PROCESS,
                          marks="not mpi", timeout=840, deselect=SIZES_ONLY)


@newest_jax_only
@pytest.mark.timeout(900)
def test_p2p_scenarios_in_one_process(simulated_suite):
    counts = simulated_suite.counts(*P2P_IN_ONE_PROCESS)
    # 82 tests, 7 of them deselected (SIZES_ONLY); JAX-vs-ours comparisons skip.
    assert counts.get("passed", 0) >= 60, counts


@newest_jax_only
@pytest.mark.timeout(900)
def test_batching_rules(simulated_suite):
    counts = simulated_suite.counts(*BATCHING)
    assert counts.get("passed", 0) >= 65, counts


@newest_jax_only
@pytest.mark.timeout(900)
def test_gpu_parity_rejections(simulated_suite):
    counts = simulated_suite.counts(*GPU_PARITY)
    assert counts.get("passed", 0) >= 28, counts


#: What changes when JAX's effect is gone too: our primitives carry an effect of our own
#: (compat/effect.py), registered where JAX allows effects in loops and conditionals and
#: where it lowers them, and the GPU-parity check finds psend/precv programs by that effect.
#: So this run takes: the parity tests, all of them (each rejection needs the check to find
#: the program by the effect); and of the single-process p2p tests those whose programs need
#: the effect allowed, lowered or found: scan, fori_loop, while_loop and cond
#: (test_control_flow, 4), the manual pipeline's loops with the parity check on (2),
#: send-compute-send-back with the check on (1), the lowered token order (1), and a psend
#: whose token is dropped, kept in the program only by its effect (1): 9 tests. The other
#: 43 vary what the effect does not reach, the same in both simulations and covered by
#: ``simulated_suite``: permutations, dtypes, empty arrays, 2-D mesh axes, FIFO order,
#: disjoint devices (large messages and the zero fill reach the handlers alone: SIZES_ONLY).
EFFECT_P2P = tuple(f"tests/lowering/test_p2p_single_process.py::{t}" for t in (
    "test_control_flow", "test_manual_pipeline_pattern", "test_send_compute_send_back",
    "test_token_orders_precv_after_psend", "test_dropped_token_still_sends"))


@newest_jax_only
@pytest.mark.timeout(600)
def test_without_jax_effect_either():
    """JAX dropped psend/precv's effect too: ours carries an equivalent, and the parity check
    (which finds psend/precv programs by that effect), loops and the lowering still work."""
    run = run_suite_part(*GPU_PARITY, *EFFECT_P2P, marks="not mpi", what="effect",
                         timeout=580)
    assert run.returncode == 0, run.output[-20000:]
    assert run.counts(*GPU_PARITY).get("passed", 0) >= 28, run.counts(*GPU_PARITY)
    assert run.counts(*EFFECT_P2P) == {"passed": 9}, run.counts(*EFFECT_P2P)


@newest_jax_only
@pytest.mark.timeout(900)
def test_pipeline_example_one_process(simulated_suite):
    counts = simulated_suite.counts(*PIPELINE_ONE_PROCESS)
    assert counts == {"passed": 1}, counts


#: Under mpirun, 2 devices per rank only. With 1 device per rank p2p_semantics.py runs the
#: same programs (fewer: no 2-D mesh), lowered by the same rule of ours whoever's primitive
#: was bound; what it adds is transport, every pair across ranks, which the suite checks
#: without the simulation (tests/runtime/test_p2p_mpi.py, 1 and 2 devices per rank), and
#: the device-thread hint for one-device programs, which finds them by the psend/precv
#: effect: in this simulation that is JAX's own effect object (ops/own_primitives.py takes
#: it where JAX has it), so the hint decides as it does with JAX's primitives
#: (tests/dispatch/test_fast_dispatch.py). With 2 devices per rank, pairs within a rank and
#: across ranks still go through our primitives. p2p_semantics.py leaves out its cases that
#: differ in sizes only (JCM_TEST_SMALL_MESSAGES_ONLY; as SIZES_ONLY above).
MPIRUN = ("tests/runtime/test_p2p_mpi.py::test_all_scenarios_over_mpi[2]",
          "tests/batching/test_batching.py::test_batching_rules_over_mpi",
          "tests/parity/test_gpu_parity.py::test_every_two_device_scenario_under_mpirun",
          "tests/test_pipeline_example.py::test_mpirun_n2x2devices_matches_reference")


@newest_jax_only
@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_under_mpirun():
    """p2p scenarios with 2 devices per rank, batching, parity, pipeline (2 x 2)."""
    run = run_suite_part(*MPIRUN, timeout=880, env={"JCM_TEST_SMALL_MESSAGES_ONLY": "1"})
    assert run.returncode == 0, run.output[-20000:]
    counts = run.counts(*MPIRUN)
    assert counts == {"passed": 4}, counts


def _subprocess_json(args: list[str], marker: str, timeout: float) -> dict:
    env = _env()
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    proc = subprocess.run([sys.executable, str(REMOVAL), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(marker)]
    assert proc.returncode == 0 and lines, proc.stdout[-5000:] + proc.stderr[-10000:]
    return json.loads(lines[-1][len(marker):])


@needs_jax_p2p
@pytest.mark.timeout(300)
def test_gpu_lowering_of_our_primitives_is_jaxs():
    """cuda and rocm exports with our own primitives == JAX's lowering of the same programs."""
    import warnings

    import jax

    ours = _subprocess_json(["-f", str(Path(programs.__file__))], "JCM-EXPORTS ", 280)
    assert ours["in_use"]["primitives"] == "jax_cpu_mpi", ours["in_use"]
    assert not ours["in_use"]["jax_has_primitives"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        reference = programs.gpu_exports(jax.lax.psend, jax.lax.precv)
    assert sorted(ours["exports"]) == sorted(reference)
    sends = 0
    for name, by_platform in reference.items():
        for platform, want in by_platform.items():
            got = ours["exports"][name][platform]
            if name in programs.ORDERED_LEAVES:  # ours orders a pytree's leaves: barriers
                assert "ops" in want and got.get("ops") == want["ops"], (name, platform, got)
            else:
                assert got == want, (name, platform)
            sends += len(want.get("ops", []))
    assert sends >= 20, reference


@pytest.mark.timeout(200)
def test_info_reports_our_primitives():
    proc = subprocess.run([sys.executable, str(REMOVAL), "-m", "jax_cpu_mpi", "info"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "primitives:    jax_cpu_mpi's own psend/precv" in proc.stdout, proc.stdout
    assert "lowerings:     psend yes, precv yes" in proc.stdout, proc.stdout
    assert "psend yes, precv yes" in proc.stdout.split("batching:", 1)[1], proc.stdout


_FEATURE_PROBE = """
import json, sys, types, warnings
import jax
import jax_p2p_removal
jax_p2p_removal.simulate()
hidden_module, hidden = sys.argv[1].split(":")
real = sys.modules[hidden_module] if hidden_module in sys.modules else __import__(
    hidden_module, fromlist=["_"])

class Hiding(types.ModuleType):  # the name moved: JAX uses it, jax_cpu_mpi cannot find it
    def __getattr__(self, name):
        if name == hidden:
            raise AttributeError(name)
        return getattr(real, name)

sys.modules[hidden_module] = Hiding(hidden_module)
import jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    n = len(jax.devices())  # JAX's plugin discovery imports jax_cpu_mpi here
import jax_cpu_mpi
mesh = jax.make_mesh((4,), ("x",))
x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
perm = [(0, 1), (1, 2), (2, 3)]
step = lambda v: jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", perm),
                                   jax.ShapeDtypeStruct(v.shape, v.dtype), "x", perm)
try:
    out = {"result": np.asarray(jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)).tolist()}
except Exception as e:
    out = {"error_type": type(e).__name__, "error": str(e)[:1000]}
out["jit_ok"] = float(jax.jit(lambda v: v.sum())(x)) == 28.0
out["states"] = {f["feature"]: f["state"] for f in jax_cpu_mpi.features()}
out["warnings"] = [str(w.message) for w in caught
                   if issubclass(w.category, jax_cpu_mpi.JaxCompatWarning)]
print("JCM-FEATURES " + json.dumps(out))
"""


def _feature_probe(hidden: str) -> dict:
    env = _env()
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(REMOVAL.parent), env.get("PYTHONPATH", "")] if p)
    proc = subprocess.run([sys.executable, "-c", _FEATURE_PROBE, hidden], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=110)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JCM-FEATURES ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-6000:]
    return json.loads(lines[-1].split(" ", 1)[1])


@pytest.mark.timeout(120)
def test_lowerings_off_gives_jax_error_for_our_primitives():
    """A name only the CPU lowerings need is gone: our primitives still exist, and on CPU
    they fail with JAX's NotImplementedError, as JAX's did without jax_cpu_mpi."""
    out = _feature_probe("jax._src.mesh:get_concrete_mesh")
    assert out["jit_ok"]
    assert out["states"]["own_primitives"] == "active", out
    assert out["states"]["lowerings"] == "off", out
    assert out["error_type"] == "NotImplementedError", out
    assert "psend is currently only implemented on GPU" in out["error"], out


@pytest.mark.timeout(120)
def test_own_primitives_off_names_the_missing_jax_name():
    """A name our primitives are built from is gone too: one warning, JAX keeps working,
    and jax_cpu_mpi.psend says what is missing."""
    out = _feature_probe("jax._src.dispatch:apply_primitive")
    assert out["jit_ok"]
    assert out["states"]["own_primitives"] == "off", out
    assert out["states"]["lowerings"] == "off", out  # nothing to attach to
    assert out["error_type"] == "RuntimeError", out
    assert "jax_cpu_mpi._src.ops.primitives:psend_p" in out["error"], out
    assert "jax._src.dispatch:apply_primitive" in out["error"], out
    assert any("(own_primitives)" in w and "apply_primitive" in w for w in out["warnings"]), out
