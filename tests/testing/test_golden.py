"""``GoldenFiles``: equal text passes, a change fails with the diff and the way to accept it,
a missing golden fails, and accepting writes exactly the text (then passes without accepting)."""

from __future__ import annotations

import pytest

from prepfuse.testing.golden import GoldenFiles

TEXT = "arg0 = placeholders()\nscratch = prepfuse.scratch.default('x', [7], bfloat16, 'cpu')\nreturn (scratch,)"


@pytest.fixture
def golden(tmp_path, monkeypatch):
    for var in ("PREPFUSE_ACCEPT", "EXPECTTEST_ACCEPT"):
        monkeypatch.delenv(var, raising=False)
    return GoldenFiles(tmp_path / "golden" / "test_mine")


@pytest.mark.parametrize("var", ["PREPFUSE_ACCEPT", "EXPECTTEST_ACCEPT"])
def test_accepting_writes_then_the_same_text_passes(golden, monkeypatch, var):
    monkeypatch.setenv(var, "1")
    golden.check(TEXT, "graph")
    assert golden.path("graph").read_text() == TEXT + "\n"
    monkeypatch.delenv(var)
    golden.check(TEXT, "graph")


def test_a_changed_line_fails_with_the_diff(golden):
    golden.path("graph").parent.mkdir(parents=True)
    golden.path("graph").write_text(TEXT + "\n")
    changed = TEXT.replace("[7]", "[8]")
    with pytest.raises(AssertionError) as err:
        golden.check(changed, "graph")
    message = str(err.value)
    assert "-scratch = prepfuse.scratch.default('x', [7]" in message
    assert "+scratch = prepfuse.scratch.default('x', [8]" in message
    assert "PREPFUSE_ACCEPT=1" in message and str(golden.path("graph")) in message


def test_a_missing_golden_fails(golden):
    with pytest.raises(AssertionError, match="does not exist"):
        golden.check(TEXT, "never_written")


def test_a_trailing_newline_is_part_of_the_text(golden):
    golden.path("graph").parent.mkdir(parents=True)
    golden.path("graph").write_text(TEXT + "\n")
    with pytest.raises(AssertionError):
        golden.check(TEXT + "\n", "graph")


def test_names_are_file_names(golden):
    with pytest.raises(ValueError, match="file name"):
        golden.path("../escape")
    with pytest.raises(TypeError, match="text to compare"):
        golden.check(["not", "text"], "graph")


def test_beside_a_test_module():
    golden = GoldenFiles.beside("/repo/tests/fx_passes/test_mine.py")
    assert str(golden.path("qwen3")) == "/repo/tests/fx_passes/golden/test_mine/qwen3.txt"
