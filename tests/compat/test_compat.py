"""JAX internals that move: a missing or changed private name switches off only its feature.

Each test runs tests/mpi_programs/compat_probe.py in an interpreter of its own: it removes
one private name before JAX's plugin discovery imports jax_cpu_mpi, then checks that
``jax.devices()`` and jitted programs still work, which features report off (in
``jax_cpu_mpi.features()`` and in ``python -m jax_cpu_mpi info --json``), what a psend/precv
program does, and which warnings were given.

Most of a fresh interpreter's time went to ``import jax``, the same in every probe, so a fork
server (tests/mpi_programs/compat_zygote.py, one per module) imports jax once and runs each
probe in a forked child, which starts from that state and never from another probe's: the
probe itself (the removal, the plugin discovery, the programs) runs unchanged in the child.
The baseline runs in a fresh interpreter as before, and the forked baseline must equal it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import jax
import pytest

from jax_cpu_mpi._src import compat as _compat
from jax_cpu_mpi._src.compat import versions as _versions
from jax_cpu_mpi._src.lowering.barrier_tokens import ORDERING_OP
from mpi_launcher import CHEAP_COMPILE_FLAGS

PROBE = Path(__file__).parents[1] / "mpi_programs" / "compat_probe.py"
ZYGOTE = PROBE.with_name("compat_zygote.py")
PROBE_TIMEOUT = 180  # seconds, for one probe (a fresh interpreter's, or a forked child's)

#: Names JAX itself needs to run a jitted program on CPU, or its own psend/precv (deleting
#: them breaks JAX with or without jax_cpu_mpi). The probe hides these from jax_cpu_mpi's
#: lookup only, as a JAX release that moved them would; every other name it deletes from
#: JAX for real (and test_issue_reproduction deletes three of these too).
JAX_NEEDS_ITSELF = frozenset({
    "jax._src.distributed:global_state",  # read when JAX makes its CPU client
    "jax._src.lax.parallel:psend_p",
    "jax._src.lax.parallel:precv_p",
    "jax._src.lax.parallel:single_side_collective_effect",
    "jax._src.lib.mlir.dialects:hlo",
    "jax._src.lib.mlir.dialects:sdy",  # JAX lowers every program with Shardy's dialect
    "jax._src.sharding_impls:SPMDAxisContext",
    "jax._src.mesh:get_concrete_mesh",
    "jax._src.interpreters.mlir:register_lowering",
    "jax._src.core:ShapedArray",
    "jax._src.interpreters.mlir:lower_jaxpr_to_module",
    "jax._src.interpreters.mlir:make_ir_context",  # JAX lowers every program in one
    "jax._src.core:abstract_token",
    "jax._src.interpreters.mlir:lower_with_sharding_in_types",
    "jax._src.interpreters.mlir:dense_int_array",
    "jax._src.interpreters.batching:fancy_primitive_batchers",
    "jax._src.interpreters.mlir:_platform_specific_lowerings",
    "jax._src.interpreters.mlir:_lowerings",  # every lowering JAX does reads it
    "jax._src.compiler:_cache_read",  # compile_or_get_cached calls it (gloo_cache_guard)
    # collectives: what JAX's own psum binds and lowers with.
    "jax._src.lax.parallel:_replica_groups",
    "jax._src.lax.parallel:psum_invariant_p",
    "jax._src.lax.parallel:unreduced_pmax_p",  # registered by JAX 0.12 itself
    "jax._src.lax.parallel:unreduced_pmin_p",
    # own_primitives (issue 15): what jax_cpu_mpi's own psend/precv are built from.
    "jax._src.core:NamedAxisEffect",
    "jax._src.core:Primitive",
    "jax._src.interpreters.mlir:aval_to_ir_type",
    "jax._src.lax.parallel:_check_axis_names",
    # fast_dispatch: what runs every compiled program.
    "jax._src.interpreters.pxla:ExecuteReplicated",
    # pipeline:split_backward: JAX's own dead-code elimination (jit and scan call it).
    "jax._src.interpreters.partial_eval:dce_jaxpr",
})

NAMES = _compat.names()


def _probe_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_CPU_MPI_DISABLE", "XLA_FLAGS"))}
    # Compiled cheaply (mpi_launcher.llvm_unoptimized()'s flags): a probe's time is mostly
    # compiling its few programs, and what it reports (which features are on, whether the
    # programs ran and equal their references) does not depend on code generation.
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=4 {CHEAP_COMPILE_FLAGS}"
    return env


def _facts(returncode: int | str, stdout: str, stderr: str) -> dict:
    output = f"exit {returncode}\n--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-4000:]}"
    assert returncode == 0, output
    lines = [line for line in stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, output
    return json.loads(lines[-1][len("PROBE "):])


def _probe_fresh(*args: str) -> dict:
    """The probe in a fresh interpreter: ``python compat_probe.py HOW PATH``."""
    run = subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True,
                         env=_probe_env(), timeout=PROBE_TIMEOUT)
    return _facts(run.returncode, run.stdout, run.stderr)


class Zygote:
    """compat_zygote.py: runs ``python SCRIPT ARGS`` as a child forked after ``import jax``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.count = 0
        self.proc: subprocess.Popen | None = None
        self.child: int | None = None
        self.facts = self._start()

    def _start(self) -> dict:
        self.log = self.workdir / f"zygote-{self.count}.stderr"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(ZYGOTE)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=_probe_env(),
                                         text=True)
        self._pending = ""
        ready = self._line(PROBE_TIMEOUT)
        assert ready.startswith("READY "), ready
        return json.loads(ready[len("READY "):])

    def _line(self, timeout: float) -> str:
        """The server's next line; a failure with its stderr if none comes within ``timeout``."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while "\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.close()
                pytest.fail(f"compat_zygote.py did not answer in {timeout} s:\n"
                            + self.log.read_text()[-4000:])
            chunk = os.read(fd, 65536).decode()
            if not chunk:
                self.close()
                pytest.fail("compat_zygote.py died:\n" + self.log.read_text()[-4000:])
            self._pending += chunk
        line, self._pending = self._pending.split("\n", 1)
        return line

    def run(self, script: Path, *args: str, timeout: float = PROBE_TIMEOUT
            ) -> tuple[int | str, str, str]:
        """A forked child's exit code (or ``"TIMEOUT"``: killed), stdout and stderr."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()  # an earlier failure closed it
        self.count += 1
        out = self.workdir / f"{self.count}.stdout"
        err = self.workdir / f"{self.count}.stderr"
        request = {"argv": [str(script), *args], "stdout": str(out), "stderr": str(err),
                   "timeout": timeout}
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            self.child = int(self._line(60).removeprefix("PID "))
            answer = self._line(timeout + 60)  # the server kills the child at ``timeout``
            self.child = None
        except BaseException:  # e.g. pytest-timeout: never leave a child or a late answer
            self.close()
            raise
        status = "TIMEOUT" if answer == "TIMEOUT" else int(answer.removeprefix("DONE "))
        read = lambda p: p.read_text(errors="replace") if p.exists() else ""  # noqa: E731
        return status, read(out), read(err)

    def probe(self, *args: str) -> dict:
        return _facts(*self.run(PROBE, *args))

    def close(self) -> None:
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.child, signal.SIGKILL)
            self.child = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote():
    with tempfile.TemporaryDirectory(prefix="compat-zygote-") as workdir:
        server = Zygote(Path(workdir))
        try:
            yield server
        finally:
            server.close()


def test_zygote_has_only_imported_jax(zygote):
    """Forking is sound only from a server that has not loaded jax_cpu_mpi, started JAX's
    backends or discovered its plugins, and runs no thread but the main one and those
    ``import numpy`` started (OpenBLAS's pool, which OpenBLAS itself stops around fork())."""
    facts = zygote.facts
    assert not facts["jax_cpu_mpi_imported"], facts
    assert not facts["backends_started"] and not facts["plugins_discovered"], facts
    assert not facts["jax_at_fork_handler"], facts
    assert facts["python_threads"] == 1, facts
    assert facts["native_threads"] == facts["native_threads_after_numpy"], facts


def test_zygote_reports_a_crash_an_exit_code_and_a_hang(zygote, tmp_path):
    """A child that dies or hangs becomes a failure with its output, never a hang."""
    script = tmp_path / "child.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "print('out', sys.argv[1:], flush=True)\n"
        "print('err', file=sys.stderr, flush=True)\n"
        "if sys.argv[1] == 'crash': os.kill(os.getpid(), signal.SIGSEGV)\n"
        "if sys.argv[1] == 'raise': raise ValueError('boom')\n"
        "if sys.argv[1] == 'hang': time.sleep(600)\n"
        "print('PROBE {\"ok\": true}')\n")
    status, out, err = zygote.run(script, "crash")
    assert status == -signal.SIGSEGV and out == "out ['crash']\n", (status, out, err)
    assert err.startswith("err\n") and "Segmentation fault" in err, err
    status, out, err = zygote.run(script, "raise")
    assert status == 1 and "ValueError: boom" in err and out == "out ['raise']\n", err
    started = time.monotonic()
    status, out, err = zygote.run(script, "hang", timeout=1)
    assert status == "TIMEOUT" and out == "out ['hang']\n", (status, out)
    assert time.monotonic() - started < 30
    with pytest.raises(AssertionError, match="exit -11"):
        _facts(*zygote.run(script, "crash"))
    with pytest.raises(AssertionError, match="exit TIMEOUT"):
        _facts(*zygote.run(script, "hang", timeout=1))
    # A child that is fine: its facts, and the server still serves after all that.
    assert _facts(*zygote.run(script, "fine")) == {"ok": True}


@pytest.fixture(scope="module")
def baseline(zygote) -> dict:
    """The probe with nothing removed, in a fresh interpreter."""
    facts = _probe_fresh("none")
    # With every name present, nothing is off and nothing warns about JAX internals.
    assert [f for f, s in facts["states"].items() if s == "off"] == []
    assert facts["compat_warnings"] == []
    # A child of the fork server finds the same: the forked probes below measure what a
    # fresh interpreter would.
    assert zygote.probe("none") == facts
    return facts


def _needing(path: str) -> set[str]:
    """The features that need ``path`` (for a module: any name in it)."""
    return {f for p, fs in NAMES.items() if p == path or p.startswith(path + ":") for f in fs}


def _expected_off(path: str) -> set[str]:
    """The features that need ``path``, and those that require them, transitively."""
    off = _needing(path)
    grew = True
    while grew:
        grew = False
        for name, f in _compat.features().items():
            if name not in off and any(r in off for r in f.requires):
                off.add(name)
                grew = True
    return off


def _optional(path: str) -> bool:
    """Names only some JAX versions have (a feature without them is "not needed")."""
    return "unreduced_pmax_p" in path or "unreduced_pmin_p" in path


def _loses_optional(feature: str, path: str) -> bool:
    """Removing ``path`` (a name or a whole module) removes an optional name of ``feature``."""
    return any(_optional(p) and (p == path or p.startswith(path + ":"))
               for p in _compat.features()[feature].names)


def _assert_jax_works(facts: dict) -> None:
    assert facts["devices"] == 4
    assert facts["jit_ok"], facts
    assert facts["shard_map_psum_ok"], facts
    assert facts["loaded_by_jax"], "JAX's plugin discovery did not import jax_cpu_mpi"


def test_every_feature_is_declared_with_names():
    states = {f["feature"]: f for f in _compat.report()}
    for name in ("lowerings", "gpu_parity", "barrier_tokens", "batching:all_gather_reduced",
                 "batching:psend", "batching:precv", "info:lowering_table"):
        assert states[name]["names"], name
    # Every private JAX path jax_cpu_mpi resolves belongs to at least one feature.
    assert all(NAMES.values())
    assert all(p.startswith("jax._src") for p in NAMES), [p for p in NAMES
                                                         if not p.startswith("jax._src")]


def test_nothing_is_off_with_this_jax(baseline):
    _assert_jax_works(baseline)
    assert baseline["p2p"] == {"result": baseline["p2p_reference"]}
    assert ORDERING_OP in baseline["barrier"]["hlo"], baseline["barrier"]
    assert baseline["info_features"] == baseline["features"]
    for name, state in baseline["states"].items():
        assert state in ("active", "not needed"), (name, state)


def test_collectives_install_whole_or_not_at_all(zygote, baseline):
    """A JAX without the lowering rule of one collective leaves the feature off with every
    collective on JAX's own lowering: none over MPI without the ordering pass that the
    feature installs after its rules (jax 0.12.1's first run left psum and all_gather over
    MPI, unordered, and pipelines over MPI hung)."""
    assert {"psum", "all_gather", "all_to_all"} <= set(baseline["cpu_mpi_rules"]), baseline
    facts = zygote.probe("drop-rule", "jax._src.lax.parallel:all_to_all_p")
    _assert_jax_works(facts)
    assert facts["states"]["collectives"] == "off", facts["states"]
    assert facts["cpu_mpi_rules"] == [], facts["cpu_mpi_rules"]
    assert any("collectives" in w for w in facts["compat_warnings"]), facts["compat_warnings"]


def test_a_collective_rewritten_before_lowering_needs_no_rule(zygote, baseline):
    """jax 0.12.1 rewrites unreduced_reduce_scatter into psum_scatter before lowering and
    has no rule for it: the collectives stay on, the others' rules all registered."""
    facts = zygote.probe("make-high", "jax._src.lax.parallel:unreduced_reduce_scatter_p")
    _assert_jax_works(facts)
    assert facts["states"]["collectives"] == "active", facts["states"]
    assert facts["compat_warnings"] == [], facts["compat_warnings"]
    assert facts["cpu_mpi_rules"] == sorted(
        set(baseline["cpu_mpi_rules"]) - {"unreduced_reduce_scatter"}), facts["cpu_mpi_rules"]


@pytest.mark.parametrize("path", sorted(NAMES))
def test_missing_private_name_switches_off_only_its_feature(baseline, zygote, path):
    how = "hide" if path in JAX_NEEDS_ITSELF or ":" not in path else "delete"
    facts = zygote.probe(how, path)
    _assert_jax_works(facts)
    expected = _expected_off(path)
    want = {}
    for name in facts["states"]:
        # A feature JAX does not need (no such primitive in this JAX) stays "not needed".
        if name not in expected or baseline["states"][name] == "not needed":
            want[name] = baseline["states"][name]
        else:
            want[name] = "not needed" if _loses_optional(name, path) else "off"
    # own_primitives is "not needed" only while jax_cpu_mpi finds JAX's psend_p/precv_p:
    # hiding their module makes it needed (and off, as it needs that module's names too).
    if path == "jax._src.lax.parallel":
        want["own_primitives"] = "off" if "own_primitives" in expected else "active"
    assert facts["states"] == want, facts["features"]
    # ONE warning per feature that is off because of the name itself (a feature that is off
    # because it requires another one is covered by that one's warning), naming the JAX
    # version, the feature and the name.
    direct = {f for f in _needing(path) if want[f] == "off"}
    warned = facts["compat_warnings"]
    assert len(warned) == len(direct), warned
    for name in direct:
        (message,) = [w for w in warned if f"({name})" in w]
        assert f"jax {jax.__version__}" in message and path in message, message
    # The info command reports the same features.
    assert facts["info_features"] == facts["features"]
    assert {f["feature"]: f["state"] for f in facts["info_features"]} == want
    # psend/precv: ours where the lowerings are active, else JAX's own error.
    if "lowerings" in expected:
        assert facts["p2p"]["error_type"] == "NotImplementedError", facts["p2p"]
        assert "only implemented on GPU" in facts["p2p"]["error"], facts["p2p"]
        assert facts["info_lowerings"] == {"psend": False, "precv": False}
    elif "psend_p" not in path and "precv_p" not in path:
        assert facts["p2p"] == {"result": baseline["p2p_reference"]}, facts["p2p"]


@pytest.mark.parametrize("path", [
    "jax._src.lax.parallel:_pcollectives_lowering_common",
    "jax._src.lax.parallel:_ppermute_batcher",
    "jax._src.lax.parallel:single_side_collective_effect",
])
def test_issue_reproduction(zygote, path):
    """The issue's reproduction: a name deleted from JAX took ``jax.devices()`` down."""
    facts = zygote.probe("delete", path)
    _assert_jax_works(facts)
    warned = facts["compat_warnings"]
    # One per feature that needs the name (a feature this JAX does not need stays silent).
    needing = [f for f in NAMES[path] if _compat.state(f) != _compat.NOT_NEEDED]
    assert len(warned) == len(needing), warned
    assert all(path in m and f"jax {jax.__version__}" in m for m in warned), warned


def test_changed_signature_switches_the_feature_off(zygote):
    facts = zygote.probe("change", "jax._src.lax.parallel:_pcollectives_lowering_common")
    _assert_jax_works(facts)
    assert facts["states"]["lowerings"] == "off"
    (why,) = [f["why"] for f in facts["features"] if f["feature"] == "lowerings"]
    assert "_pcollectives_lowering_common changed: its signature lacks" in why, why
    assert facts["p2p"]["error_type"] == "NotImplementedError", facts["p2p"]


def test_parity_check_that_breaks_while_running_switches_itself_off(zygote):
    """A changed internal seen only when a program is lowered: jit keeps working."""
    facts = zygote.probe("break-parity", "-")
    _assert_jax_works(facts)
    assert facts["p2p"] == {"result": facts["p2p_reference"]}, facts["p2p"]
    assert facts["states"]["gpu_parity"] == "off"
    (message,) = facts["compat_warnings"]
    assert "(gpu_parity)" in message and "failed while running" in message, message


def test_barrier_that_breaks_while_running_falls_back_to_jax(zygote):
    facts = zygote.probe("break-barrier", "-")
    _assert_jax_works(facts)
    assert facts["states"]["barrier_tokens"] == "off"
    # JAX's own rule lowered the barrier (or raised JAX's own error, as without us).
    assert "error_type" in facts["barrier"] or ORDERING_OP not in facts["barrier"]["hlo"]
    (message,) = facts["compat_warnings"]
    assert "(barrier_tokens)" in message, message


# ------------------------------------------------------------------ tested versions


def test_tested_versions_include_this_one_in_ci():
    """CI runs only tested versions; a new JAX must be added here once its suite passes."""
    assert jax.__version__ in _versions.TESTED_JAX_VERSIONS, (
        f"jax {jax.__version__} is not in TESTED_JAX_VERSIONS: run the whole suite with it, "
        "then add it to jax_cpu_mpi/_versions.py and the tested versions in "
        "docs/getting-started.md")


def test_gloo_cache_guard_only_on_a_jaxlib_with_the_hang():
    assert not _versions.has_gloo_cache_hang("0.12.0.1")
    assert not _versions.has_gloo_cache_hang("0.10.2")
    assert not _versions.has_gloo_cache_hang(None)
    assert _versions.has_gloo_cache_hang("0.12.1")
    assert _versions.has_gloo_cache_hang("0.13.0.dev20270101")  # until one is tested
    want = "active" if _versions.has_gloo_cache_hang(_versions.jaxlib_version()) else \
        "not needed"
    assert _compat.state("gloo_cache_guard") == want


def test_gloo_cache_guard_finds_xla_collectives_not_ours():
    from jax_cpu_mpi._src.runtime.gloo_cache import has_xla_collectives

    for op in ("all-reduce", "all-gather-start", "reduce-scatter", "all-to-all",
               "collective-permute-start", "collective-broadcast", "ragged-all-to-all"):
        assert has_xla_collectives([f"  %x.1 = f32[4]{{0}} {op}(f32[4]{{0}} %p), ..."]), op
    # An instruction merely named after one, and our collectives (custom calls), are not.
    assert not has_xla_collectives(["  %all-reduce.3 = f32[] add(f32[] %a, f32[] %b)",
                                    '  %c = f32[4]{0} custom-call(f32[4]{0} %p), '
                                    'custom_call_target="jax_cpu_mpi_all_reduce"'])


def test_untested_version_warns_once_naming_both_versions(monkeypatch):
    assert _versions.untested_message(_versions.TESTED_JAX_VERSIONS[0],
                                      _versions.TESTED_JAX_VERSIONS[0]) is None
    message = _versions.untested_message("0.13.0", "0.13.0")
    assert message is not None and "jax 0.13.0" in message
    assert "0.10.2" in message and "info" in message
    assert "jaxlib 0.12.1" in _versions.untested_message("0.12.0.1", "0.12.1")
    monkeypatch.setattr(jax, "__version__", "0.13.0")
    monkeypatch.setattr(_versions, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _versions.warn_if_untested()
        _versions.warn_if_untested()
    assert [w.category for w in caught] == [_versions.UntestedJaxWarning]


# ---------------------------------------------------------------- XLA FFI API versions


def test_ffi_api_of_a_newer_build_is_refused_before_registration():
    from jax_cpu_mpi._src.ffi import abi_version as _ffi_version

    built = (0, 5, "jaxlib 0.12.0.1")
    assert _ffi_version.mismatch_message(built, (0, 5), "0.12.0.1") is None
    assert _ffi_version.mismatch_message(built, (0, 6), "0.13.0") is None  # older API: fine
    assert _ffi_version.mismatch_message(built, None, "?") is None  # unknown: try
    message = _ffi_version.mismatch_message(built, (0, 4), "0.11.2")
    assert message is not None
    assert "XLA FFI API 0.5 (the headers of jaxlib 0.12.0.1)" in message
    assert "jaxlib 0.11.2 supports (0.4)" in message and "--no-build-isolation" in message
    assert _ffi_version.mismatch_message((1, 0, ""), (0, 9), "x") is not None  # major differs


def test_this_build_matches_the_installed_jaxlib():
    from jax_cpu_mpi._src.ffi import abi_version as _ffi_version

    major, minor, headers = _ffi_version.built_api()
    assert _ffi_version.runtime_api() == (major, minor)
    assert _ffi_version.mismatch() is None
    assert headers.startswith("jaxlib ")
