"""Sphinx directives that generate pages from the package, so that docs and code cannot drift.

* ``jcm-config-table``: every ``JAX_CPU_MPI_*`` variable and :func:`jax_cpu_mpi.configure`
  key, from ``jax_cpu_mpi.config.VARIABLES`` (the one place they are defined). The build
  fails if a :class:`jax_cpu_mpi.Config` field has no variable.
* ``jcm-api``: the API reference of every name in ``jax_cpu_mpi.__all__`` (functions,
  classes, errors and warnings, constants), each from its docstring. A name added to
  ``__all__`` appears without touching the docs; ``:exclude:`` names ones documented
  elsewhere on the page.

Both generate MyST Markdown and parse it in place (the pages are MyST).
"""

from __future__ import annotations

import dataclasses
import inspect

from docutils.parsers.rst import Directive, directives
from sphinx.util.docutils import SphinxDirective


def _parse(directive: SphinxDirective, text: str) -> list:
    from docutils import nodes
    from docutils.statemachine import StringList

    container = nodes.section() if False else nodes.container()
    directive.state.nested_parse(StringList(text.splitlines(), source="(generated)"),
                                 directive.content_offset, container)
    return container.children


class ConfigTable(SphinxDirective):
    """The table of every ``JAX_CPU_MPI_*`` variable, from the registry."""

    has_content = False
    option_spec = {"kind": directives.unchanged}

    def run(self) -> list:
        from jax_cpu_mpi import config

        fields = {f.name for f in dataclasses.fields(config.Config)}
        with_variable = {v.field for v in config.VARIABLES if v.field}
        if fields - with_variable:
            raise self.error(f"Config fields without a JAX_CPU_MPI_* variable in "
                             f"config.VARIABLES: {sorted(fields - with_variable)}")
        kinds = [k.strip() for k in self.options.get("kind", "").split(",") if k.strip()]
        lines = ["| variable | `configure()` key | default | meaning |", "|---|---|---|---|"]
        for var in config.VARIABLES:
            if kinds and var.kind not in kinds:
                continue
            key = f"`{var.field}`" if var.field else ""
            meaning = var.meaning.replace("|", "\\|")
            lines.append(f"| `{var.name}` | {key} | `{var.default}` | {meaning} |")
        return _parse(self, "\n".join(lines))


def _kind(obj: object) -> str:
    if inspect.isclass(obj):
        if issubclass(obj, Warning):
            return "warnings"
        if issubclass(obj, BaseException):
            return "errors"
        return "classes"
    if callable(obj):
        return "functions"
    return "data"


_TITLES = {"functions": "Functions", "classes": "Classes", "errors": "Errors",
           "warnings": "Warnings", "data": "Constants"}
_DIRECTIVE = {"functions": "autofunction", "classes": "autoclass", "errors": "autoexception",
              "warnings": "autoexception", "data": "autodata"}


class PublicApi(SphinxDirective):
    """Autodoc entries for every name of ``jax_cpu_mpi.__all__``, grouped by kind."""

    has_content = False
    option_spec = {"exclude": directives.unchanged}

    def run(self) -> list:
        import jax_cpu_mpi

        exclude = set(self.options.get("exclude", "").split())
        groups: dict[str, list[str]] = {k: [] for k in _TITLES}
        for name in jax_cpu_mpi.__all__:
            if name in exclude or name.startswith("__"):
                continue
            groups[_kind(getattr(jax_cpu_mpi, name))].append(name)
        out: list[str] = []
        for kind, names in groups.items():
            if not names:
                continue
            out += [f"## {_TITLES[kind]}", ""]
            for name in names:
                options = [":members:"] if kind == "classes" else []
                if kind == "data":
                    options = [":no-value:"] if name != "TESTED_JAX_VERSIONS" else []
                out += [f"```{{{_DIRECTIVE[kind]}}} jax_cpu_mpi.{name}", *options, "```", ""]
        return _parse(self, "\n".join(out))


def setup(app):  # noqa: ANN001
    app.add_directive("jcm-config-table", ConfigTable)
    app.add_directive("jcm-api", PublicApi)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


__all__ = ["ConfigTable", "Directive", "PublicApi", "setup"]
