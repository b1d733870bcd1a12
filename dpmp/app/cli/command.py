"""What every ``dpmp`` command is made of, and the options several share.

A command is a ``Command``: its name and help, a function that adds its
options to its sub-parser, its handler, and the modules it needs. Adding a
command is a new module that defines one as ``COMMAND`` and its name in
``dpmp.app.cli.entry._BUILT_IN`` (or ``entry.register_command(command)``).

Nothing here imports JAX, NumPy or dp-accounting: ``dpmp --help`` and each
command's ``--help`` stay fast. A handler imports what it uses when it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

__all__ = [
    "Command",
    "LibraryChoices",
    "UsageError",
    "add_config_args",
    "check_config_args",
    "integer",
    "config_from_args",
]

_EXAMPLE_CONFIGS = "configs/default.toml, configs/fp16.toml, configs/fp32.toml, ..."


class UsageError(Exception):
    """A user error: printed as one line, exit status 2."""


@dataclasses.dataclass(frozen=True)
class Command:
    """One ``dpmp`` command.

    Attributes:
      name: what the user types after ``dpmp``.
      help: its line in ``dpmp --help``.
      description: the text ``dpmp NAME --help`` opens with.
      add_arguments: adds the command's options to its sub-parser.
      run: the handler, ``run(args) -> exit status``; it raises
        ``UsageError`` (or a ``ValueError`` naming the field) for a user
        error, printed as one line with status 2.
      imports: modules loaded before ``run`` with Ctrl-C held (see
        ``dpmp.app.cli.entry``): a native extension interrupted half-way through
        its initialisation is left broken.
      distributed: ``distributed(args)``, the ``jax.distributed.initialize``
        arguments the command was given, or None; the processes join before
        the backend starts.
    """

    name: str
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    imports: tuple[str, ...] = ()
    distributed: Callable[[argparse.Namespace], dict | None] | None = None


class LibraryChoices(Sequence[str]):
    """The allowed values of an option, as a library layer lists them (sorted).

    The list is read when argparse first needs it (checking a value, printing the
    option's help), so that building the parser imports no library layer. Set it
    as the action's ``choices`` after ``add_argument``, which would otherwise
    format it at once.
    """

    def __init__(self, module: str, name: str):
        self._module, self._name = module, name

    def _names(self) -> tuple[str, ...]:
        return tuple(sorted(getattr(importlib.import_module(self._module), self._name)))

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, value: object) -> bool:
        return value in self._names()


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer (``1,000,000`` and ``1_000_000`` too) in
    ``[low, high]`` (no upper bound when ``high`` is None)."""

    def parse(text: str) -> int:
        try:
            n = int(text.replace(",", "").replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if high is None and n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        if high is not None and not low <= n <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {n}")
        return n

    return parse


def add_config_args(p: argparse.ArgumentParser) -> None:
    """``--config``, ``--set`` and ``--data``: the run config a command works on."""
    p.add_argument(
        "--config",
        metavar="PATH",
        help=f"TOML config (default: the built-in default run; see {_EXAMPLE_CONFIGS})",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override a config key, e.g. --set privacy.target_epsilon=4 (repeatable)",
    )
    p.add_argument(
        "--data",
        metavar="PATH",
        help="train on your own arrays: a .npz with x, y (and optionally x_test, y_test), or "
        "a folder of x_train.npy, y_train.npy, x_test.npy, y_test.npy (memory-mapped)",
    )
    # run by `dpmp.app.cli.entry` before the command's libraries load
    p.set_defaults(precheck=check_config_args)


def check_config_args(args: argparse.Namespace) -> None:
    """Names a missing config file or a mistyped section or key before JAX is imported
    (``dpmp.app.config.raw_config`` reads names only; the values are checked later)."""
    from dpmp.app.config import raw_config

    raw_config(args.config, _overrides(args))


def config_from_args(args: argparse.Namespace):
    """The ``dpmp.Config`` that ``--config``, ``--set`` and ``--data`` describe."""
    from dpmp.app.config import load_config

    return load_config(args.config, _overrides(args))


def _overrides(args: argparse.Namespace) -> list[str]:
    overrides = list(args.overrides)
    if getattr(args, "data", None):
        kind = _data_kind(args.data)
        overrides += [f"data.dataset={kind}", f"data.path={json.dumps(str(Path(args.data)))}"]
    return overrides


def _data_kind(data: str) -> str:
    """``"npy"`` for a folder of ``.npy`` files, ``"npz"`` for a ``.npz`` file."""
    path = Path(data)
    if path.is_dir():
        if not (path / "x_train.npy").is_file():
            raise UsageError(
                f"--data: {data!r} is a folder without x_train.npy (a .npz file, or a "
                "folder of x_train.npy, y_train.npy, x_test.npy, y_test.npy)"
            )
        return "npy"
    if path.suffix != ".npz":
        raise UsageError(f"--data: expected a .npz file or a folder of .npy files, got {data!r}")
    if not path.exists():
        raise UsageError(f"--data: no such file {data!r}")
    if not path.is_file():
        raise UsageError(f"--data: {data!r} is not a regular file")
    return "npz"
