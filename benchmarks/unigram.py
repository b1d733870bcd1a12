"""The unigram baseline of a text config: held-out perplexity of the training
records' byte frequencies (add-one smoothing). NOT private: it reads the exact
counts of the training data; it is a reference point for the docs only.

Run: ``python benchmarks/unigram.py [--config configs/lm.toml]``; prints JSON.
"""

import argparse
import json

import numpy as np

from dpmp.app.config import load_config
from dpmp.app.inputs import load_data
from dpmp.data._text import PAD


def targets(tokens: np.ndarray) -> np.ndarray:
    """The predicted bytes of every record (padding left out)."""
    t = tokens[:, 1:]
    return t[t != PAD]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/lm.toml")
    args = parser.parse_args()
    config = load_config(args.config)
    data = load_data(config.data, config.training.seed)
    train, test = targets(data.x_train), targets(data.x_test)
    counts = np.bincount(train, minlength=256).astype(np.float64) + 1.0
    cross_entropy = float(-np.log(counts[test] / counts.sum()).mean())
    print(
        json.dumps(
            {
                "config": args.config,
                "train_tokens": int(len(train)),
                "test_tokens": int(len(test)),
                "unigram_test_loss": cross_entropy,
                "unigram_test_perplexity": float(np.exp(cross_entropy)),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
