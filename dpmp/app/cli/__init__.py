"""The ``dpmp`` command: train, audit, compare, budget, report, export.

One module per command (``train``, ``audit``, ``compare``, ``budget``,
``report``, ``export``), each defining a ``Command`` that adds
its options to its sub-parser and handles them; ``entry`` lists them and holds
``main`` and the console script ``console``.

Errors in arguments, configs or data print one line naming the field and what
is allowed, and exit with status 2 (no traceback). ``dpmp audit`` exits 1 when
the audit finds a violation. ``dpmp train`` exits 3 when the run ended but did
not do what was asked (stopped early by the budget, a failed audit, parameters
that are not finite, most examples overflowed), saying why; 130 on Ctrl-C.
"""

from dpmp.app.cli.entry import console as console
from dpmp.app.cli.entry import main as main

__all__ = ["console", "main"]
