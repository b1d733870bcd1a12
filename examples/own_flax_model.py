"""Your own flax linen model, trained privately by dpmp's trainer: from the command
line and from Python.

The file defines a small convolutional network and a factory
``factory(input_shape, num_classes)`` that returns it. The trainer does the
rest: Poisson sampling, clipping in float32 after the bf16 backward pass,
snapped float32 noise, accounting, checkpoints, the report and the audit.
From the command line (the folder of this file on ``PYTHONPATH``)::

    PYTHONPATH=examples dpmp train --out runs/own \\
        --set model.kind=own_flax_model:factory --set training.physical_batch_size=128

and from Python, as ``main()`` below does::

    report = dpmp.train(config, out_dir="runs/own_py", model=factory((8, 8, 1), 10))

Each logical batch (Poisson, expected size 512) is processed in physical
chunks of 128 examples: the clipped sums are added up in float32 and noised
once per step, so the compiled memory is that of 128 examples.

Expected output (2 CPU cores, about 30 s; the accuracy varies by a few
points between runs, 0.89 to 0.93 seen: the noise and the batches are fresh
and secret each time):

    model: user model ConvNet (flax.linen) on inputs (8, 8, 1), 10 classes (5,050 parameters)
    clipping: ghost (requested auto)
    epsilon 2.000 (delta 1e-05), test accuracy 0.93

Run: ``python examples/own_flax_model.py [--steps N] [--out DIR]``
"""

import argparse

import flax.linen as nn

import dpmp


class ConvNet(nn.Module):
    """Two 3x3 convolutions and a linear head. No BatchNorm: each example's
    gradient must depend on that example alone (GroupNorm would do)."""

    num_classes: int

    @nn.compact
    def __call__(self, x):  # x: [batch, 8, 8, 1]
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(16, (3, 3), strides=(2, 2))(x))
        return nn.Dense(self.num_classes)(x.reshape((x.shape[0], -1)))


def factory(input_shape, num_classes):
    """What ``model.kind = "own_flax_model:factory"`` calls."""
    del input_shape  # flax infers the input size at init
    return ConvNet(num_classes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="runs/own_flax_model")
    args = parser.parse_args()
    config = dpmp.load_config(
        None,
        [
            f"training.steps={args.steps}",
            "training.physical_batch_size=128",
        ],
    )
    report = dpmp.train(
        config, out_dir=args.out, resume=False, progress=False, model=factory((8, 8, 1), 10)
    )
    print(f"model: {report['model']['description']} ({report['num_params']:,} parameters)")
    clip = report["clipping"]
    print(f"clipping: {clip['method']} (requested {clip['method_requested']})")
    print(
        f"epsilon {report['epsilon']:.3f} (delta {report['delta']:g}), "
        f"test accuracy {report['test_accuracy']:.2f}"
    )


if __name__ == "__main__":
    main()
