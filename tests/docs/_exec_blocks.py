"""Run doc blocks in this interpreter, each in a fresh namespace as ``__main__``.

Usage: ``python _exec_blocks.py RESULTS.json BLOCK.py...`` (tests/docs/test_examples.py).
Writes ``{path: {"stdout", "error", "warnings"}}``: the block's stdout, its traceback if it
raised, and the DeprecationWarnings raised from its own lines.
"""

import contextlib
import io
import json
import runpy
import sys
import traceback
import warnings

results_path, *paths = sys.argv[1:]
results = {}
for path in paths:
    out = io.StringIO()
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        try:
            with contextlib.redirect_stdout(out):
                sys.argv = [path]
                runpy.run_path(path, run_name="__main__")
        except BaseException:
            error = traceback.format_exc()
    deprecations = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
                    if issubclass(w.category, DeprecationWarning) and w.filename == path]
    results[path] = {"stdout": out.getvalue(), "error": error, "warnings": deprecations}
    sys.stdout.flush()
with open(results_path, "w") as f:
    json.dump(results, f)
