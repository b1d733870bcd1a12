"""``python -m dpmp``: the ``dpmp`` command."""

from dpmp.app.cli import console

if __name__ == "__main__":
    raise SystemExit(console())
