"""The documentation site builds with ``sphinx-build -W`` (every warning an error).

No network: no intersphinx, nothing fetched; the build runs in a temporary folder. The API
reference imports the installed package (its docstrings), the configuration table reads
``jax_cpu_mpi.config.VARIABLES`` (docs/_ext/jcm_docs.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import _newest_tested_series

# The site is made of our sources and docstrings by Sphinx: the JAX version changes nothing
# in it but through `import jax_cpu_mpi`, which the rest of the suite checks on every JAX.
# CI runs the suite on the oldest and the newest JAX: the build (tens of CPU-seconds) runs
# on the newest only, and the CMake configure test (tests/test_packaging.py) on the other.
pytestmark = pytest.mark.skipif(
    not _newest_tested_series(),
    reason="the Sphinx build does not depend on the JAX version: it runs on the newest "
           "tested JAX series only (CI's second run, the README's command on Python >= 3.12)")

pytest.importorskip("sphinx", reason="the docs extra (sphinx, myst-parser, furo) is missing")
pytest.importorskip("myst_parser")
pytest.importorskip("furo")

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _build(builder: str, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # The suite's 8 virtual devices do not matter here; keep JAX quiet and local.
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-j", "1", "-E",
         "-b", builder, "-d", str(out / "doctrees"), str(DOCS), str(out / builder)],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def html(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs")
    proc = _build("html", out)
    assert proc.returncode == 0, f"sphinx-build -W failed:\n{proc.stdout}\n{proc.stderr}"
    return out / "html"


def test_every_page_is_built_and_in_the_toctree(html: Path):
    pages = {p.stem for p in DOCS.glob("*.md")}
    built = {p.stem for p in html.glob("*.html")}
    assert pages <= built, sorted(pages - built)
    index = (html / "index.html").read_text()
    for page in pages - {"index"}:
        assert f'href="{page}.html"' in index, f"{page}.md is not in the index's toctree"


def test_generated_tables_and_api_are_filled_in(html: Path):
    import jax_cpu_mpi
    from jax_cpu_mpi import config

    configuration = (html / "configuration.html").read_text()
    for var in config.VARIABLES:
        assert var.name in configuration, var.name
    api = (html / "api.html").read_text()
    for name in jax_cpu_mpi.__all__:
        if not name.startswith("__"):
            assert f'id="jax_cpu_mpi.{name}"' in api, f"jax_cpu_mpi.{name} is not documented"
    assert ".. py:" not in api and ".. auto" not in api, "unrendered reStructuredText"


def test_no_page_shows_raw_markup(html: Path):
    """MyST renders what it parses; a directive it did not know would show as text."""
    for page in html.glob("*.html"):
        text = re.sub(r"<[^>]+>", "", page.read_text())
        assert "```{" not in text and "{eval-rst}" not in text, page.name
