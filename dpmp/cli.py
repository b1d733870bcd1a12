"""``python -m dpmp.cli``: the ``dpmp`` command, whose code is ``dpmp.app.cli``."""

from dpmp.app.cli import console as console
from dpmp.app.cli import main as main

__all__ = ["console", "main"]

if __name__ == "__main__":
    raise SystemExit(console())
