"""Held-out perplexity of the private language model at epsilon 1, 2 and 8, three
ways: trained from scratch (``configs/lm.toml``), LoRA on a model pre-trained on
public text (``configs/lm_lora.toml``) and full fine-tuning of that model
(``configs/lm_lora.toml`` with ``model.lora_rank = 0`` and the learning rate of
``configs/lm.toml``). Every run is a real private run of ``dpmp.train`` with
fresh secret noise; the public pre-training is done once and its parameters
(``pretrained/``) copied into the other runs' directories, where they are
reused (their spec matches).

Run: ``python benchmarks/lm_lora.py [--out runs/lm_lora] [--epsilons 1 2 8]``
(about 40 minutes on 2 CPU cores); prints a Markdown table and writes
``benchmarks/results/lm_lora.json``.
"""

import argparse
import json
import shutil
import time
from pathlib import Path

import dpmp
from dpmp.app.config import load_config

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "from scratch": ("configs/lm.toml", []),
    "LoRA after public pre-training": ("configs/lm_lora.toml", []),
    "full fine-tuning after public pre-training": (
        "configs/lm_lora.toml",
        ["model.lora_rank=0", "training.learning_rate=3e-3"],
    ),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/lm_lora")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 8.0])
    parser.add_argument("--json", default=str(ROOT / "benchmarks/results/lm_lora.json"))
    parser.add_argument("--set", action="append", default=[], help="config override, all runs")
    args = parser.parse_args()
    out = Path(args.out)
    shared = out / "pretrained"  # the public pre-training, made by the first run needing it
    rows = []
    for mode, (path, sets) in MODES.items():
        for eps in args.epsilons:
            config = load_config(ROOT / path, [*sets, *args.set, f"privacy.target_epsilon={eps}"])
            run = out / f"{Path(path).stem}{'_full' if sets else ''}_eps{eps:g}"
            if config.pretrain.enabled and shared.is_dir():
                shutil.rmtree(run / "pretrained", ignore_errors=True)
                shutil.copytree(shared, run / "pretrained")
            tic = time.perf_counter()
            report = dpmp.train(config, out_dir=run, resume=False, progress=False)
            seconds = time.perf_counter() - tic
            if config.pretrain.enabled and not shared.is_dir():
                shutil.copytree(run / "pretrained", shared)
            start = report["starting_point"] or {}
            rows.append(
                {
                    "mode": mode,
                    "config": path,
                    "overrides": sets,
                    "target_epsilon": eps,
                    "epsilon": report["epsilon"],
                    "test_perplexity": report["test_perplexity"],
                    "test_accuracy": report["test_accuracy"],
                    "trainable_params": report["num_params"],
                    "pretrain_public_perplexity": start.get("public_test_perplexity"),
                    "seconds": round(seconds, 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    rows.append(pretrained_only(shared))
    print(json.dumps(rows[-1]), flush=True)
    Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print("\n| | " + " | ".join(f"eps {e:g}" for e in args.epsilons) + " |")
    print("| --- |" + " --- |" * len(args.epsilons))
    for mode in MODES:
        cells = [f"{r['test_perplexity']:.2f}" for r in rows if r["mode"] == mode]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    print(f"| {rows[-1]['mode']} | {rows[-1]['test_perplexity']:.2f} (epsilon 0) |")


def pretrained_only(shared: Path) -> dict:
    """The pre-trained model on the private test records, before any private step
    (epsilon 0: it never saw them)."""
    import jax
    import numpy as np

    from dpmp.app.inputs import load_data, model_from_config
    from dpmp.app.trainer.evaluate import evaluator

    config = load_config(ROOT / "configs/lm_lora.toml")
    data = load_data(config.data, config.training.seed)
    model = model_from_config(config.model, data, config.precision)
    params = dpmp.load_params(shared, jax.eval_shape(model.init, jax.random.key(0)))
    accuracy, loss = evaluator(model, input_dtype=np.int32)(params, data.x_test, data.y_test)
    return {
        "mode": "public pre-training alone, no private step",
        "config": "configs/lm_lora.toml",
        "target_epsilon": 0.0,
        "epsilon": 0.0,
        "test_perplexity": float(np.exp(loss)),
        "test_accuracy": accuracy,
    }


if __name__ == "__main__":
    main()
