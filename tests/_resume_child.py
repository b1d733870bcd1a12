"""Runs ``dpmp``'s trainer in a child process for the kill-and-resume test.

Usage: ``python tests/_resume_child.py OUT_DIR SLEEP_S [section.key=value ...]``

Sleeps ``SLEEP_S`` after every step (through the step callback, which touches
no training state) so that the parent can SIGKILL it mid-run.
"""

import sys
import time

from dpmp._src.config import load_config
from dpmp._src.trainer import train


def main() -> None:
    out_dir, sleep_s, *overrides = sys.argv[1:]
    config = load_config(None, overrides)
    pause = float(sleep_s)
    train(
        config,
        out_dir=out_dir,
        resume=True,
        progress=False,
        callback=lambda step, info: time.sleep(pause),
    )


if __name__ == "__main__":
    main()
