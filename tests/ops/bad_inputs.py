"""What every op's bad-input tests share: a case is a change to good arguments, and the op
must refuse it with a ValueError whose message starts with the argument's name, eagerly or
through its fake impl (as torch.compile's tracing calls it)."""

from __future__ import annotations

import pytest

from prepfuse.testing import call_with_fake_tensors


def changed(args: dict, change) -> dict:
    """``args`` with the entries ``change(args)`` returns replaced (a copy)."""
    args = dict(args)
    args.update(change(args) or {})
    return args


def assert_rejected(op, args: dict, name: str, *, fake: bool) -> None:
    """``op`` refuses ``args`` naming ``name`` (``fake``: through its fake impl); nothing else raises."""
    with pytest.raises(ValueError, match=rf"^{name}: "):
        if fake:
            call_with_fake_tensors(op, args)
        else:
            op(*args.values())
