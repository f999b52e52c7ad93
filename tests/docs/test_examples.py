"""Every code example of README.md and docs/*.md runs as written and prints what the page shows.

The convention (markers for device counts, mpirun, shell commands and skips) is described in
``doc_blocks.py``. Single-process blocks with the same device count share one interpreter,
each in a fresh namespace (so a block that needs a name from another one fails); mpirun
blocks run through ``tests/mpi_launcher.py`` with a timeout.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import doc_blocks
import pytest
from doc_blocks import ROOT, Block, Run

from mpi_launcher import CHEAP_COMPILE_FLAGS, run_mpi

HERE = Path(__file__).resolve().parent
BLOCKS = doc_blocks.all_blocks()
_WORK = Path(tempfile.mkdtemp(prefix="jcm-doc-blocks-"))
atexit.register(shutil.rmtree, _WORK, ignore_errors=True)
_results: dict[tuple, dict] = {}


def _env(devices: int) -> dict[str, str]:
    """This environment with exactly ``devices`` CPU devices (the suite's conftest sets 8)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags.strip()} --xla_force_host_platform_device_count={devices}".strip()
    env.pop("JCM_TEST_DEVICES_PER_PROCESS", None)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _file(block: Block) -> str:
    name = f"{block.page.stem}_{block.line}.py".replace("-", "_")
    path = _WORK / name
    path.write_text(block.code)
    return str(path)


def _group(block: Block, run: Run) -> tuple:
    if run.isolated:
        return ("isolated", block.where, run.devices)
    return ("shared", run.devices)


def _run_group(key: tuple, run: Run) -> dict:
    """Run every block of the group in one interpreter; {path: result}."""
    members = [b for b in BLOCKS for r in b.runs
               if r.mode == "python" and _group(b, r) == key]
    paths = [_file(b) for b in members]
    results_path = _WORK / f"results-{abs(hash(key))}.json"
    timeout = sum(r.timeout for b in members for r in b.runs if _group(b, r) == key)
    # Compiled cheaply (mpi_launcher.llvm_unoptimized()): these interpreters are mostly
    # compiling the blocks' programs, and what the blocks print (booleans of comparisons
    # within a tolerance, shapes, exact small values) does not depend on how the kernels
    # are generated.
    env = _env(run.devices)
    env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} {CHEAP_COMPILE_FLAGS}"
    try:
        proc = subprocess.run([sys.executable, str(HERE / "_exec_blocks.py"), str(results_path),
                               *paths], env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=_WORK)
    except subprocess.TimeoutExpired as e:
        return {p: {"error": f"timed out after {timeout} s (a deadlock?); stderr:\n"
                             f"{e.stderr}", "stdout": e.stdout or "", "warnings": []}
                for p in paths}
    if proc.returncode != 0 or not results_path.exists():
        return {p: {"error": f"the interpreter failed (exit {proc.returncode}):\n"
                             f"{proc.stderr[-5000:]}", "stdout": "", "warnings": []}
                for p in paths}
    found = json.loads(results_path.read_text())
    for result in found.values():
        result["stderr"] = proc.stderr[-3000:]
    return found


def _run_python(block: Block, run: Run) -> dict:
    key = _group(block, run)
    if key not in _results:
        _results[key] = _run_group(key, run)
    return _results[key][_file(block)]


def _run_mpirun(block: Block, run: Run) -> dict:
    outdir = tempfile.mkdtemp(prefix="jcm-doc-mpi-", dir=_WORK)
    job = run_mpi(str(HERE / "_mpi_block.py"), _file(block), outdir, nprocs=run.nprocs,
                  devices_per_process=run.devices, timeout=run.timeout,
                  env={"XLA_FLAGS": _env(run.devices)["XLA_FLAGS"]})
    stdout_path = Path(outdir) / "stdout-0.txt"
    stdout = stdout_path.read_text() if stdout_path.exists() else ""
    error = None if job.returncode == 0 else job.report()
    return {"stdout": stdout, "error": error, "warnings": [], "stderr": job.report()}


def _run_shell(block: Block, run: Run) -> dict:
    try:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=ROOT,
                              env=_env(run.devices), capture_output=True, text=True,
                              timeout=run.timeout)
    except subprocess.TimeoutExpired:
        return {"stdout": "", "error": f"timed out after {run.timeout} s", "warnings": []}
    error = None if proc.returncode == 0 else f"exit {proc.returncode}:\n{proc.stderr}"
    return {"stdout": proc.stdout, "error": error, "warnings": [], "stderr": proc.stderr}


def _normalized(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


CASES = [pytest.param(b, r, id=f"{b.where}[{r.label()}]") for b in BLOCKS for r in b.runs]


@pytest.mark.parametrize(("block", "run"), CASES)
def test_example_runs_as_written(block: Block, run: Run):
    if run.mode == "mpirun":
        pytest.importorskip("mpi4py")
        result = _run_mpirun(block, run)
    elif run.mode == "shell":
        result = _run_shell(block, run)
    else:
        result = _run_python(block, run)
    assert result["error"] is None, f"{block.where} failed as written:\n{result['error']}"
    assert not result["warnings"], f"{block.where} warns: {result['warnings']}"
    if block.expected is not None:
        assert _normalized(result["stdout"]) == _normalized(block.expected), (
            f"{block.where} printed\n{result['stdout']}\nbut the page shows\n{block.expected}"
            f"\n(stderr: {result.get('stderr', '')[-2000:]})")


def test_every_page_follows_the_convention():
    """Parsing raised nothing (at import); every python block runs or says why not; the
    marked outputs belong to blocks that run."""
    assert BLOCKS, "no code blocks found"
    for block in BLOCKS:
        if block.lang == "python":
            assert block.runs or block.skip, block.where
        if block.expected is not None:
            assert block.runs, f"{block.where}: an output block for a block that is not run"


def test_the_convention_parser_catches_mistakes(tmp_path: Path):
    """A marker separated from its block, an output without a block, an unknown word."""
    bad = {
        "stray.md": "<!-- run: devices=2 -->\n\ntext\n```python\nx = 1\n```\n",
        "output.md": "<!-- output -->\n```text\n1\n```\n",
        "word.md": "<!-- run: devices=2 gpus=1 -->\n```python\nx = 1\n```\n",
    }
    for name, text in bad.items():
        page = tmp_path / name
        page.write_text(text)
        with pytest.raises(doc_blocks.ConventionError):
            doc_blocks.parse_page(page)
    page = tmp_path / "ok.md"
    page.write_text("<!-- run: devices=2 -->\n<!-- run: mpirun -n 2 devices=1 -->\n"
                    "```python\nprint(1)\n```\n\n<!-- output -->\n```text\n1\n```\n")
    (block,) = doc_blocks.parse_page(page)
    assert [r.label() for r in block.runs] == ["devices=2", "mpirun -n 2 devices=1"]
    assert block.expected == "1\n"


def test_skipped_examples_say_why():
    skipped = [(b.where, b.skip) for b in BLOCKS if b.skip]
    for where, reason in skipped:
        assert len(reason) > 10, f"{where}: say why the block is not run"
