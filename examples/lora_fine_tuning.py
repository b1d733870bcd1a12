"""Public pre-training, then private LoRA fine-tuning of a language model.

``configs/lm_lora.toml`` first trains the byte-level transformer WITHOUT
privacy on public text: the docstrings of Python's standard library, read
from its source files (they ship with Python). That costs no epsilon: no
private record is read. Then it freezes every pre-trained parameter and
trains only rank-8 low-rank adapters (``model.lora_rank``) with DP-SGD on the
private records (lines of Python's documentation). Clipping, the noise and
the accounting cover exactly the adapters, about a sixth of the parameters;
the frozen ones come out bit for bit as they went in.

The pre-trained parameters are saved in the run's ``pretrained/`` folder
(public) and reused by later runs in that folder while the ``[pretrain]``
section, the model and the public text stay the same.

Expected output (2 CPU cores, about 6-10 minutes; the noise and the batches are
fresh and secret each run, so the last digits vary):

    public pre-training: 500 steps on 26051 records, held-out public perplexity 6.3
    private LoRA: 21,008 trainable parameters, the model's 137,538 frozen
    epsilon 7.979 (delta 1e-05), held-out perplexity 5.7 (from scratch: 13.06)

The from-scratch figure is the measured run at the same epsilon and steps in
``benchmarks/results/lm_lora.json``; other settings say none was measured.

(The pre-trained model alone, before any private step, has held-out
perplexity 7.1 on the private records: ``python benchmarks/lm_lora.py``.)

Run: ``python examples/lora_fine_tuning.py [--epsilon E] [--steps N] [--pretrain-steps N]
[--out DIR]``
"""

import argparse
import json
from pathlib import Path

import dpmp

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "lm_lora.toml"
RESULTS = ROOT / "benchmarks" / "results" / "lm_lora.json"
MEASURED_STEPS = 200  # the private steps of each run in RESULTS


def from_scratch(epsilon: float, steps: int) -> str:
    """The measured held-out perplexity of training from scratch at this epsilon
    and number of steps, or that none was measured."""
    if steps == MEASURED_STEPS and RESULTS.is_file():
        for run in json.loads(RESULTS.read_text()):
            if run.get("mode") == "from scratch" and run.get("target_epsilon") == epsilon:
                return f"from scratch: {run['test_perplexity']:.2f}"
    return f"from scratch at epsilon {epsilon:g} and {steps} steps: not measured"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--pretrain-steps", type=int, default=500)
    parser.add_argument("--out", default="runs/lora_fine_tuning")
    args = parser.parse_args()
    config = dpmp.load_config(
        CONFIG,
        [
            f"privacy.target_epsilon={args.epsilon}",
            f"training.steps={args.steps}",
            f"pretrain.steps={args.pretrain_steps}",
        ],
    )
    report = dpmp.train(config, out_dir=args.out, resume=False, progress=False)
    start = report["starting_point"]
    print(
        f"public pre-training: {start['steps']} steps on {start['records']} records, "
        f"held-out public perplexity {start['public_test_perplexity']:.1f}"
    )
    frozen = report["model"]["description"].split("its ")[-1].split(" parameters")[0]
    print(
        f"private LoRA: {report['num_params']:,} trainable parameters, the model's {frozen} frozen"
    )
    print(
        f"epsilon {report['epsilon']:.3f} (delta {report['delta']:g}), held-out perplexity "
        f"{report['test_perplexity']:.1f} ({from_scratch(args.epsilon, args.steps)})"
    )


if __name__ == "__main__":
    main()
