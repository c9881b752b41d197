"""Golden texts kept as files: a pass test asserts the exact post-pass graph in one line.

A golden graph inline in a test is a 10-line string that looks like every other one, and a
change to one scratch name rewrites forty of them by hand. Here each lives in its own file
beside the test module (``golden/<module>/<name>.txt``), is compared as text with a unified
diff on mismatch, and is rewritten by running the failing tests again with
``PREPFUSE_ACCEPT=1`` (``EXPECTTEST_ACCEPT=1`` works too, so one variable regenerates
these and any inline expecttest string).

    from prepfuse.testing.golden import GoldenFiles
    golden = GoldenFiles.beside(__file__)
    ...
    golden.check(report.graph, "qwen3")   # tests/.../golden/test_mine/qwen3.txt

What to put in a golden: the normalized graph of ``prepfuse.fx_passes.graph_print``
(``report.graph`` with ``record_graphs``), which already names nodes by order, not by
Inductor's counters, so it is stable across runs and machines.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

__all__ = ["GoldenFiles", "accepting"]

_NAME = re.compile(r"[A-Za-z0-9_.+-]+")


def accepting() -> bool:
    """True when goldens are being rewritten (``PREPFUSE_ACCEPT=1`` or ``EXPECTTEST_ACCEPT=1``)."""
    return any(os.environ.get(v, "") not in ("", "0") for v in ("PREPFUSE_ACCEPT", "EXPECTTEST_ACCEPT"))


class GoldenFiles:
    """One folder of golden texts, one ``<name>.txt`` per golden; see the module docstring."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)

    @classmethod
    def beside(cls, test_file: str | os.PathLike) -> GoldenFiles:
        """The folder ``golden/<test module name>/`` next to ``test_file`` (pass ``__file__``)."""
        path = Path(test_file)
        return cls(path.parent / "golden" / path.stem)

    def path(self, name: str) -> Path:
        if not _NAME.fullmatch(name):
            raise ValueError(f"golden name {name!r}: use letters, digits and _ . + - only (it is a file name)")
        return self.folder / f"{name}.txt"

    def check(self, actual: str, name: str) -> None:
        """Assert ``actual`` equals the golden ``name``; write it instead when accepting.

        The file holds the text and one final newline. A missing file fails (a golden
        nobody wrote proves nothing) unless accepting.
        """
        if not isinstance(actual, str):
            raise TypeError(f"golden {name!r}: expected the text to compare, got {type(actual).__name__}")
        path = self.path(name)
        if accepting():
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists() or path.read_text() != actual + "\n":
                path.write_text(actual + "\n")
            return
        if not path.exists():
            raise AssertionError(f"golden {path} does not exist; run again with PREPFUSE_ACCEPT=1 to write it")
        expected = path.read_text()
        if expected.endswith("\n"):
            expected = expected[:-1]
        if actual != expected:
            diff = "\n".join(difflib.unified_diff(
                expected.splitlines(), actual.splitlines(), f"{path} (golden)", "actual", lineterm=""))
            raise AssertionError(
                f"the text differs from golden {path}; if the change is intended, "
                f"run again with PREPFUSE_ACCEPT=1 to rewrite it\n{diff}")
