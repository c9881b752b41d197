"""Schema drift, for any op namespace: snapshot the exact schemas, and fail with a diff
naming each changed op when the registered ones move.

A schema is a contract that functionalization, graph passes and callers all read; a
stale copy once went untested in production (docs/design.md, lesson 3). One line in a
user's pytest holds their namespace to a committed snapshot::

    from prepfuse.testing.drift import check_schemas

    def test_my_op_schemas():
        check_schemas("tests/golden/myns_schemas.txt", namespace="myns")

After an intended change, rewrite the snapshot with ``PREPFUSE_ACCEPT=1 python -m pytest
-k test_my_op_schemas`` (``EXPECTTEST_ACCEPT=1`` too) and review the diff. The file holds a
header comment and ``str(op._schema)`` of every overload, sorted, one per line.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Iterable

import torch

from prepfuse.ops._library import ops_in
from prepfuse.testing.golden import accepting

__all__ = ["ops_of", "schemas_of", "schema_drift", "check_schemas", "read_snapshot", "write_snapshot"]


def ops_of(namespace: str) -> list[torch._ops.OpOverload]:
    """Every overload registered in ``namespace``, sorted by schema."""
    if not isinstance(namespace, str) or not namespace or "::" in namespace:
        raise ValueError(f"namespace: expected an op namespace such as 'prepfuse', got {namespace!r}")
    return ops_in(namespace)


def schemas_of(namespace: str | None = None, ops: Iterable | None = None) -> list[str]:
    """Sorted ``str(op._schema)`` of ``ops`` (overloads, or packets: every overload), or of
    every op of ``namespace``; exactly one of the two."""
    if (namespace is None) == (ops is None):
        raise ValueError("give namespace or ops, not both and not neither")
    if namespace is not None:
        return [str(op._schema) for op in ops_of(namespace)]
    found = []
    for op in ops:
        if isinstance(op, torch._ops.OpOverloadPacket):
            found += [str(getattr(op, name)._schema) for name in op.overloads()]
        elif isinstance(op, torch._ops.OpOverload):
            found.append(str(op._schema))
        else:
            raise ValueError(f"ops: expected torch op overloads or packets, got {op!r}")
    return sorted(found)


def schema_drift(registered: list[str], snapshot: list[str], *, snapshot_name: str = "snapshot") -> str:
    """A unified diff from ``snapshot`` to ``registered``, then one line per changed op
    (``changed: ns::name``, ``added: ...``, ``removed: ...``); empty when they agree."""
    registered, snapshot = sorted(registered), sorted(snapshot)
    if registered == snapshot:
        return ""
    diff = "\n".join(difflib.unified_diff(snapshot, registered, snapshot_name, "registered", lineterm=""))
    old, new = {_op_name(s): s for s in snapshot}, {_op_name(s): s for s in registered}
    lines = [f"changed: {n}" for n in sorted(old.keys() & new.keys()) if old[n] != new[n]]
    lines += [f"added: {n}" for n in sorted(new.keys() - old.keys())]
    lines += [f"removed: {n}" for n in sorted(old.keys() - new.keys())]
    return diff + "\n" + "\n".join(lines)


def _op_name(schema: str) -> str:
    """``ns::name.overload`` of a schema string."""
    return schema.split("(", 1)[0]


def read_snapshot(path: str | os.PathLike) -> list[str]:
    """The snapshot's schema lines (comments and blank lines dropped)."""
    lines = Path(path).read_text().splitlines()
    return [line for line in lines if line.strip() and not line.startswith("#")]


def write_snapshot(path: str | os.PathLike, schemas: list[str], header: str | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = header or "# str(op._schema) of every op, sorted; regenerate: PREPFUSE_ACCEPT=1 python -m pytest <this test>"
    path.write_text(header.rstrip("\n") + "\n" + "".join(f"{s}\n" for s in sorted(schemas)))


def check_schemas(path: str | os.PathLike, *, namespace: str | None = None, ops: Iterable | None = None,
                  header: str | None = None) -> None:
    """Assert the registered schemas of ``namespace`` (or ``ops``) equal the snapshot at
    ``path``; with ``PREPFUSE_ACCEPT=1`` (or ``EXPECTTEST_ACCEPT=1``) write it instead. A
    missing snapshot fails unless accepting. The failure holds the diff and names each op."""
    registered = schemas_of(namespace, ops)
    path = Path(path)
    if accepting():
        if not path.exists() or read_snapshot(path) != registered:
            write_snapshot(path, registered, header)
        return
    if not path.exists():
        raise AssertionError(f"schema snapshot {path} does not exist; run again with PREPFUSE_ACCEPT=1 to write it")
    drift = schema_drift(registered, read_snapshot(path), snapshot_name=str(path))
    if drift:
        raise AssertionError(
            f"the registered op schemas differ from the snapshot {path}. If the change is intended, update "
            f"every caller and pass that reads the schema, then rewrite it with PREPFUSE_ACCEPT=1\n{drift}")
