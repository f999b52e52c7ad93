"""Sphinx directives that generate pages from the package, so that docs and code cannot drift.

* ``jcm-config-table``: every ``JAX_CPU_MPI_*`` variable and :func:`jax_cpu_mpi.configure`
  key, from ``jax_cpu_mpi.config.VARIABLES`` (the one place they are defined). The build
  fails if a :class:`jax_cpu_mpi.Config` field has no variable.
* ``jcm-api``: the API reference of every name in ``jax_cpu_mpi.__all__`` (modules, functions,
  classes, errors and warnings, constants), each from its docstring. A name added to
  ``__all__`` appears without touching the docs; ``:exclude:`` names ones documented
  elsewhere on the page.

Both generate MyST Markdown and parse it in place (the pages are MyST).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import ClassVar

from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective


def _parse(directive: SphinxDirective, text: str) -> list:
    from docutils import nodes
    from docutils.statemachine import StringList

    container = nodes.container()
    directive.state.nested_parse(StringList(text.splitlines(), source="(generated)"),
                                 directive.content_offset, container)
    return container.children


class ConfigTable(SphinxDirective):
    """The table of every ``JAX_CPU_MPI_*`` variable, from the registry."""

    has_content = False
    option_spec: ClassVar[dict] = {"kind": directives.unchanged}

    def run(self) -> list:
        from jax_cpu_mpi import config

        fields = {f.name for f in dataclasses.fields(config.Config)}
        with_variable = {v.field for v in config.VARIABLES if v.field}
        if fields - with_variable:
            raise self.error(f"Config fields without a JAX_CPU_MPI_* variable in "
                             f"config.VARIABLES: {sorted(fields - with_variable)}")
        kinds = [k.strip() for k in self.options.get("kind", "").split(",") if k.strip()]
        labels = {"runtime": "", "build": "build: ", "ci": "CI: ", "bench": "benchmarks: "}
        lines = ["| variable | `configure()` key | default | meaning |", "|---|---|---|---|"]
        for var in config.VARIABLES:
            if kinds and var.kind not in kinds:
                continue
            key = f"`{var.field}`" if var.field else ""
            meaning = labels.get(var.kind, f"{var.kind}: ") + var.meaning.replace("|", "\\|")
            lines.append(f"| `{var.name}` | {key} | `{var.default}` | {meaning} |")
        if len(lines) == 2:
            raise self.error(f"no JAX_CPU_MPI_* variable of kind {kinds}")
        return _parse(self, "\n".join(lines))


def _kind(obj: object) -> str:
    if inspect.ismodule(obj):
        return "modules"
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
           "warnings": "Warnings", "data": "Constants", "modules": "Modules"}
_DIRECTIVE = {"functions": "autofunction", "classes": "autoclass", "errors": "autoexception",
              "warnings": "autoexception", "data": "autodata", "modules": "automodule"}


def _attribute_doc(name: str, obj: object) -> list[str]:
    """The ``#:`` comment above ``name`` in the jax_cpu_mpi module that defines it."""
    import sys

    from sphinx.pycode import ModuleAnalyzer

    for modname, module in sorted(sys.modules.items()):
        if not modname.startswith("jax_cpu_mpi") or getattr(module, name, None) is not obj:
            continue
        try:
            docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        except Exception:
            continue
        if ("", name) in docs:
            return [line for line in docs[("", name)] if line.strip()]
    raise ValueError(f"jax_cpu_mpi.{name}: no '#:' comment documents it where it is defined")


class PublicApi(SphinxDirective):
    """Autodoc entries for every name of ``jax_cpu_mpi.__all__``, grouped by kind."""

    has_content = False
    option_spec: ClassVar[dict] = {"exclude": directives.unchanged}

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
            # autodoc writes reStructuredText: parse its directives as such (eval-rst).
            out.append("```{eval-rst}")
            for name in names:
                obj = getattr(jax_cpu_mpi, name)
                if kind == "data":  # a value has no docstring: its #: comment where defined
                    out += [f".. py:data:: jax_cpu_mpi.{name}", f"   :value: {obj!r}", "",
                            *(f"   {line}" for line in _attribute_doc(name, obj)), ""]
                    continue
                options = {"classes": [":members:", ":undoc-members:"],
                           "modules": [":members:"]}.get(kind, [])
                out += [f".. {_DIRECTIVE[kind]}:: jax_cpu_mpi.{name}",
                        *(f"   {o}" for o in options), ""]
            out += ["```", ""]
        return _parse(self, "\n".join(out))


def setup(app):
    app.add_directive("jcm-config-table", ConfigTable)
    app.add_directive("jcm-api", PublicApi)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


__all__ = ["ConfigTable", "PublicApi", "setup"]
