"""One printed line per thing the demo checks (an op's implementation, an example model):
what was fused, the numbers against their bounds, ok or FAIL, and the time on a GPU."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bound:
    """One checked number: ``value <= limit``, printed with both."""

    what: str
    value: float
    limit: float

    @property
    def ok(self) -> bool:
        return self.value <= self.limit

    def __str__(self) -> str:
        if isinstance(self.limit, int):  # counts: codes, bytes
            return f"{self.what} {self.value} <= {self.limit}"
        return f"{self.what} {self.value:.1e} <= {self.limit:.1e}"


@dataclass(frozen=True)
class Row:
    """The line of one check: an example model (``fused``), or an implementation of an op
    (``impl``). ``ok``: every bound holds, every expected call was fused, and ``holds`` (a
    check that is no single number, stated in ``numerics``)."""

    name: str
    bounds: tuple[Bound, ...] = ()
    numerics: str = ""
    holds: bool = True
    fused: tuple[int, int] | None = None  # (calls fused, calls expected)
    impl: str = ""
    timing: str = ""

    @property
    def ok(self) -> bool:
        fused_all = self.fused is None or self.fused[0] == self.fused[1]
        return self.holds and fused_all and all(b.ok for b in self.bounds)

    def format(self) -> str:
        second = f"fused {self.fused[0]}/{self.fused[1]}" if self.fused else self.impl
        numerics = ", ".join([*map(str, self.bounds), *([self.numerics] if self.numerics else [])])
        line = f"  {self.name:<25} {second:<10}  {numerics}  {'ok' if self.ok else 'FAIL'}"
        return f"{line}  {self.timing}" if self.timing else line
