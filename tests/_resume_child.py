"""Runs ``dpmp``'s trainer in a child process for the kill-and-resume test.

Usage: ``python tests/_resume_child.py OUT_DIR SLEEP_S ENTROPY_SEED [section.key=value ...]``

Sleeps ``SLEEP_S`` after every step (through the step callback, which touches
no training state) so that the parent can SIGKILL it mid-run. The OS entropy
that the run's secret keys come from is replaced by a stream seeded with
``ENTROPY_SEED`` (``tests/_entropy.py``), so that the parent can compare a
killed and resumed run with an uninterrupted one that drew the same keys.
"""

import sys
import time

from _entropy import FakeEntropy

from dpmp.app.config import load_config
from dpmp.app.trainer import train
from dpmp.noise import _entropy as entropy


def main() -> None:
    out_dir, sleep_s, entropy_seed, *overrides = sys.argv[1:]
    entropy._urandom = FakeEntropy(int(entropy_seed))
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
