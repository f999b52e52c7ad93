"""docs/troubleshooting.md quotes every error and warning message the package can raise.

Scanned from the source, so that a new message without a troubleshooting entry fails here:

* Python (``python/jax_cpu_mpi``, but the ``bench`` and ``examples`` command-line tools): every
  call that builds an exception or warning (``raise X(...)``, ``warnings.warn(...)``,
  ``Variable.error(...)``, the parity check's ``Violation(...)``) and every function whose
  name says it makes a message: the longest literal piece of its text (15 characters or more;
  the values formatted into it vary) must appear on the page;
* XLA's own messages that the GPU-parity check reproduces (``parity/rule.py``);
* C++: the literal text of every ``ffi::Error`` built in ``cpp/ffi/p2p_handlers.cc`` (the one
  file that turns the transports' statuses into XLA errors) and of every ``Status::Invalid`` /
  ``Status::SendTimeout`` in ``cpp/``.

Whitespace is normalized on both sides (the page may wrap a message).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "troubleshooting.md"
PACKAGE = ROOT / "python" / "jax_cpu_mpi"
TOOLS = ("bench", "examples")  # command-line tools with their own argparse-style messages
MIN_PIECE = 15


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _pieces(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _pieces(node.left) + _pieces(node.right)
    if isinstance(node, ast.Tuple | ast.List):
        return [p for elt in node.elts for p in _pieces(elt)]
    return []


def _callee(func: ast.AST) -> str:
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def _builds_message(call: ast.Call) -> bool:
    name = _callee(call.func)
    return name.endswith(("Error", "Warning")) or name in ("warn", "error", "Violation")


def _key(pieces: list[str]) -> str | None:
    found = [_norm(p).strip(" .,:;()") for p in pieces]
    found = [p for p in found if len(p) >= MIN_PIECE]
    return max(found, key=len) if found else None


def python_messages() -> dict[str, str]:
    """{source location: the phrase the page must quote}."""
    wanted: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if set(path.relative_to(PACKAGE).parts[:1]) & set(TOOLS):
            continue
        tree = ast.parse(path.read_text())
        # A module's __getattr__ (PEP 562) raises Python's standard "module ... has no
        # attribute ..." AttributeError, as for any missing attribute: not a message of ours.
        standard = {id(call) for fn in ast.walk(tree)
                    if isinstance(fn, ast.FunctionDef) and fn.name == "__getattr__"
                    for call in ast.walk(fn)
                    if isinstance(call, ast.Call) and _callee(call.func) == "AttributeError"}
        for node in ast.walk(tree):
            pieces: list[str] = []
            if isinstance(node, ast.Call) and _builds_message(node) and id(node) not in standard:
                pieces = [p for arg in node.args for p in _pieces(arg)]
            elif isinstance(node, ast.FunctionDef) and (
                    "message" in node.name or node.name == "mismatch"):
                body = node.body[1:] if ast.get_docstring(node) else node.body
                pieces = [p for stmt in body for sub in ast.walk(stmt) for p in _pieces(sub)
                          if isinstance(sub, ast.Constant | ast.JoinedStr)]
            key = _key(pieces)
            if key:
                wanted[f"{rel}:{node.lineno}"] = key
    rule = PACKAGE / "_src" / "parity" / "rule.py"
    for node in ast.walk(ast.parse(rule.read_text())):
        for piece in _pieces(node) if isinstance(node, ast.Constant | ast.JoinedStr) else []:
            text = _norm(piece).strip(" .,:;()")
            if text.startswith(("Expected send", "Expected recv", "Deadlock")) and \
                    len(text) >= MIN_PIECE:
                wanted[f"{rule.relative_to(ROOT)}:{node.lineno} (XLA's)"] = text
    return wanted


def _cpp_code(text: str) -> str:
    """The code without comments and without `#include` lines (a header's quoted path is
    not a message)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(re.sub(r"//.*$", "", line) for line in text.splitlines()
                     if not line.lstrip().startswith("#include"))


_LITERAL = r'"((?:[^"\\]|\\.)*)"'


def cpp_messages() -> dict[str, str]:
    wanted: dict[str, str] = {}
    handlers = ROOT / "cpp" / "ffi" / "p2p_handlers.cc"
    for m in re.finditer(_LITERAL, _cpp_code(handlers.read_text())):
        text = _norm(m.group(1)).strip(" .,:;()")
        if len(text) >= 25:
            wanted[f"{handlers.relative_to(ROOT)}: {text[:30]}"] = text
    for path in sorted((ROOT / "cpp").rglob("*")):
        if path.suffix not in (".cc", ".h"):
            continue
        code = _cpp_code(path.read_text())
        for m in re.finditer(r"Status::(?:Invalid|SendTimeout)\(\s*" + _LITERAL, code):
            wanted[f"{path.relative_to(ROOT)}: {m.group(1)[:30]}"] = \
                _norm(m.group(1)).strip(" .,:;()")
        for m in re.finditer(r"\bk\w*(?:Message|NotUsable)\w*\s*=\s*" + _LITERAL, code):
            wanted[f"{path.relative_to(ROOT)}: {m.group(1)[:30]}"] = \
                _norm(m.group(1)).strip(" .,:;()")
    return wanted


def test_the_scan_finds_the_messages():
    """The scan itself works: it finds messages we know exist (else the page test is empty)."""
    py = python_messages()
    cpp = cpp_messages()
    assert len(py) >= 30 and len(cpp) >= 15, (len(py), len(cpp))
    assert any("counted from the end" in v for v in py.values())
    assert any("Deadlock detected" in v for v in py.values())
    assert any("would reinterpret the sender's" in v for v in cpp.values())


def test_troubleshooting_quotes_every_message():
    page = _norm(PAGE.read_text())
    missing = {where: text for where, text in {**python_messages(), **cpp_messages()}.items()
               if text not in page}
    assert not missing, (
        "docs/troubleshooting.md does not quote these messages (add an entry: the message, "
        "its cause, the fix):\n" + "\n".join(f"  {w}: {t!r}" for w, t in missing.items()))
