"""The ``dpmp`` parser, ``main`` and the console script ``console``.

``COMMANDS`` is the registry of commands (a ``dpmp._registry.Registry``), in
the order ``dpmp --help`` shows them; a new command is a module defining a
``Command`` and its name in ``_BUILT_IN`` (built in) or
``register_command(command)``. ``main`` parses the arguments (importing
nothing heavy, so that ``--help`` is fast), loads what the command needs with
Ctrl-C (and SIGTERM) held, runs it and turns its errors into one line and an
exit status."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterable, Sequence

from dpmp._registry import Registry
from dpmp.app.cli.command import Command, UsageError

__all__ = ["COMMANDS", "console", "main", "parser", "register_command"]

# The built-in commands, in the order ``dpmp --help`` lists them: each is the
# ``COMMAND`` of its module ``dpmp.app.cli.<name>``, loaded when the parser is
# built (none imports JAX).
_BUILT_IN = ("train", "tune", "audit", "compare", "budget", "report", "export", "generate")
COMMANDS: Registry[Command] = Registry(
    "command", {name: f"dpmp.app.cli.{name}:COMMAND" for name in _BUILT_IN}, protocol=Command
)


def register_command(command: Command, *, replace: bool = False) -> Command:
    """Makes ``command`` a ``dpmp`` command (``dpmp NAME``, listed in ``--help``
    after the built-in ones); returns it.

    Raises:
      TypeError: ``command`` lacks a field of ``Command`` (named).
      ValueError: the name is taken and ``replace`` is false.
    """
    return COMMANDS.register(command, replace=replace)


def _version() -> str:
    """The installed version, from the package metadata."""
    from importlib import metadata

    try:
        return metadata.version("dpmp")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree, not installed
        return "unknown (not installed)"


def parser(commands: Iterable[Command] = COMMANDS) -> argparse.ArgumentParser:
    """The ``dpmp`` argument parser: one sub-parser per command."""
    top = argparse.ArgumentParser(
        prog="dpmp",
        description="Differentially private training in JAX with precision controls.",
    )
    top.add_argument("--version", action="version", version=f"dpmp {_version()}")
    sub = top.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in commands:
        p = sub.add_parser(command.name, help=command.help, description=command.description)
        command.add_arguments(p)
    return top


def _import_all(modules: Sequence[str], distributed: dict | None = None) -> None:
    """Imports ``modules`` with Ctrl-C and SIGTERM held until they are loaded, then raises it.

    A KeyboardInterrupt raised inside a native extension's initialisation
    (jaxlib's) leaves it half-loaded: the interpreter reported an ImportError
    traceback, or lost the interrupt altogether and trained on. Importing is a
    second or two, so holding Ctrl-C that long is the safe way to stop there.
    """
    if threading.current_thread() is not threading.main_thread():
        for name in modules:
            importlib.import_module(name)
        _join(distributed)
        return
    pressed = []
    previous = {
        s: signal.signal(s, lambda signum, frame: pressed.append(signum)) for s in _STOP_SIGNALS
    }
    try:
        for name in modules:
            importlib.import_module(name)
        _join(distributed)  # before the backend starts
        if "jax" in modules:
            sys.modules["jax"].devices()  # the backend's own start-up, also native
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if pressed:
        _stop(pressed[0], None)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop(signum: int, frame) -> None:
    """Ctrl-C and SIGTERM alike raise KeyboardInterrupt, which says which it was."""
    stop = KeyboardInterrupt()
    stop.signum = signum
    raise stop


def _join(distributed: dict | None) -> None:
    if distributed is not None:
        from dpmp.app.trainer.mesh import initialize

        try:
            initialize(**distributed, named="--coordinator, --num-processes and --process-id")
        except ValueError as e:
            raise UsageError(str(e)) from None


def main(argv: list[str] | None = None, *, commands: Iterable[Command] = COMMANDS) -> int:
    """Runs ``dpmp ARGV`` and returns its exit status.

    0 done; 1 an audit found a violation; 2 an error in the arguments, the config
    or the data (one line on stderr naming the field and what is allowed;
    ``DPMP_DEBUG=1`` raises it instead); 3 a run that ended without doing what
    was asked (``dpmp train``); 130 Ctrl-C; 143 SIGTERM (a run saves a checkpoint
    first, as for Ctrl-C); 141 the reader of stdout went away.
    """
    args = parser(commands).parse_args(argv)
    command = next(c for c in commands if c.name == args.command)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop) if main_thread else None
    try:
        distributed = None if command.distributed is None else command.distributed(args)
        if getattr(args, "precheck", None) is not None:
            args.precheck(args)  # a config typo is named before JAX starts
        _import_all(command.imports, distributed)
        return command.run(args)
    except KeyboardInterrupt as e:
        # A run stopped between steps says where its checkpoint is (RunInterrupted).
        signum = getattr(e, "signum", signal.SIGINT)
        how = "interrupted" if signum == signal.SIGINT else "stopped by SIGTERM"
        print(f"dpmp {args.command}: {str(e) or how + '; nothing new was saved'}", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:
        # The reader (e.g. `| head`) closed the pipe: stop quietly, as Unix tools do
        # (status 128 + SIGPIPE); point stdout at /dev/null so the exit flush is silent.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except (UsageError, ValueError, OSError) as e:
        # ConfigError, DataError, PrecisionError, CheckpointError and accounting errors
        # are ValueErrors whose messages name the field and the allowed values; an
        # OSError names the path it could not read or write. DPMP_DEBUG=1 re-raises.
        if os.environ.get("DPMP_DEBUG"):
            raise
        print(f"dpmp {args.command}: error: {e}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def console() -> int:
    """The ``dpmp`` console script: ``main``, leaving at once after Ctrl-C.

    After an interrupt the run has already unwound (checkpoint saved, files
    closed, lock released), but XLA's compiler threads may still be at work, and
    tearing the interpreter down under them crashed it (SIGSEGV instead of 130).
    """
    status = main()
    if status in (130, 143):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
