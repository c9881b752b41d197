"""Inputs and comparisons shared by the tests, the benchmark and the demo.

Checks follow one rule: fresh random data every run, outputs poisoned before the call
(q_out with -123.0, every cache byte with 0xA5), so a byte that should have been written and
was not shows up, and a byte that should not have been written shows up too.

One module per family (``dsv4``, ``dsv4_full_row``, ``gqa``, ``dsv4_indexer``), what they share (``common``) and
the demo's quick GPU timing (``timing``); each op's reference and kernel by name (``impls``)
and whether a duplicated slot's row is whole (``duplicate_slots``), imported by their module;
and the kit for engine teams' own ops and passes:
golden files for graph tests (``golden``), pass tests beside eager (``passes``), schema drift
(``drift``) and functionalization checks (``functionalization``), imported by their module;
the rest is exported here too.
"""

from prepfuse.testing.common import *  # noqa: F401,F403
from prepfuse.testing.dsv4 import *  # noqa: F401,F403
from prepfuse.testing.dsv4_full_row import *  # noqa: F401,F403
from prepfuse.testing.dsv4_indexer import *  # noqa: F401,F403
from prepfuse.testing.golden import *  # noqa: F401,F403
from prepfuse.testing.gqa import *  # noqa: F401,F403
from prepfuse.testing.timing import *  # noqa: F401,F403
