"""Sphinx configuration of the jax-cpu-mpi documentation (MyST Markdown, furo).

Build: ``sphinx-build -W -b html docs docs/_build/html`` (the `docs` extra). The test suite
builds it the same way (tests/docs/test_docs_build.py). Nothing here reaches the network.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

project = "jax-cpu-mpi"
author = "the jax-cpu-mpi authors"
copyright = "the jax-cpu-mpi authors, Apache-2.0"

try:
    from jax_cpu_mpi import __version__ as release
except Exception:  # the pages still build; the API reference then fails loudly under -W
    release = "unknown"
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "jcm_docs",  # docs/_ext/jcm_docs.py: tables generated from the package itself
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]
templates_path: list[str] = []

myst_enable_extensions = ["colon_fence", "deflist"]
# Links like [Launchers](launchers.md#launchers) resolve to the headings' anchors.
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
# The package is imported as installed (its extension is compiled); never mock it.

html_theme = "furo"
html_title = f"jax-cpu-mpi {release}"
html_static_path = ["_static"] if (HERE / "_static").is_dir() else []
# No intersphinx: the build must not reach the network (it runs in the test suite).
