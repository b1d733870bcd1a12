"""The private step of a run, built from its config, and its audits.

``build_private_step(config)`` reads the config's data, model, sampler and
privacy plan, and builds the step from those objects with
``dpmp.step.private_step`` (which knows no config: a loop of one's own uses it
directly)::

    grad_fn  = dpmp.private_grad(model.loss_fn, l2_clip_norm=privacy.l2_clip_norm,
                                 policy=config.precision, method=privacy.clip_method)
    fn       = dpmp.private_step(grad_fn, optax optimizer of training.optimizer,
                                 noise_multiplier=plan.noise_multiplier (calibrated),
                                 noise_key=keys.noise (OS entropy),
                                 padded_batch_size=sampler.padded_batch_size,
                                 physical_batch_size=training.physical_batch_size,
                                 mesh=make_mesh(config) (training.devices),
                                 frozen=model.frozen (a LoRA base, or None), ...)
    state    = fn.init(params, loss scale of [loss_scale])

``PrivateStep`` is that step with what the loop needs beside it: real
arguments and the initial state, the data its batches are read from, the
model it trains, the sampler, the plan and the keys. The config stays the
caller's. What one step computes (physical chunks, the mesh, the sensitivity
the noise is drawn for) is said in ``dpmp.step``.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpmp.app.config import Config, ConfigError
from dpmp.app.config_checkpoint import CHECKPOINT_KINDS
from dpmp.app.inputs import load_data, model_from_config
from dpmp.app.published import start_from_checkpoint
from dpmp.app.trainer.batches import feature_stats as compute_feature_stats
from dpmp.app.trainer.batches import gather, make_sampler
from dpmp.app.trainer.mesh import make_mesh, shared_keys
from dpmp.app.trainer.plan import (
    NoisePlan,
    RunKeys,
    max_truncation_prob,
    noise_plan,
    run_keys,
    units,
)
from dpmp.audit._precision import audit_precision
from dpmp.audit._privacy import privacy_audit
from dpmp.clipping._private_grad import private_grad
from dpmp.clipping._private_loss_scale import PrivateDynamicLossScale
from dpmp.clipping._users import user_private_grad
from dpmp.data._dataset import Dataset
from dpmp.data._preprocess import FeatureStats, standardize
from dpmp.models._lora import lora_model
from dpmp.models._model import Model, count_bytes, count_params
from dpmp.models._params_file import arrange, load_params_file, param_names
from dpmp.models.families import FAMILIES
from dpmp.noise._mechanisms import mechanism
from dpmp.noise._registry import sampler
from dpmp.precision._loss_scale import (
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
)
from dpmp.step._mesh import DataParallelMesh
from dpmp.step._step import PrivateStepFn, _static, private_step

__all__ = [
    "AUDIT_EXPECT",
    "PrivateStep",
    "audit_step",
    "audit_summary",
    "build_private_step",
    "check_step_memory",
    "privacy_audit_step",
    "step_memory",
]

# Sites every private step must show; all_reduce only exists on several devices.
AUDIT_EXPECT = ("batch_reduction", "norm", "noise_sample", "noise_add", "update")


@dataclasses.dataclass(frozen=True, eq=False)
class PrivateStep:
    """The private step of a run (``build_private_step``) and what the loop needs
    beside it; ``step_fn, example_args = build_private_step(config)`` unpacks it.

    Attributes:
      step_fn: the step the loop calls, ``step_fn(params, batch,
        is_padding_example, opt_state, loss_scale) -> (params, opt_state,
        loss_scale, stats)`` (``fn.step_fn``).
      fn: the ``dpmp.step.PrivateStepFn`` it is: ``fn.grad_fn``,
        ``fn.optimizer``, ``fn.sensitivity`` (the L2 sensitivity the noise is
        drawn for), ``fn.mesh`` (None on one device) and ``fn.chunked`` (the
        pieces of a step over physical chunks, or None).
      example_args: real arguments for ``step_fn`` (initial state, batch 0).
      init_state: the initial ``params``, ``opt_state`` and ``loss_scale``
        (on the mesh, if there is one). A donating step (``build_private_step(...,
        donate=True)``, the trainer's) deletes them, and ``example_args``'
        state, at its first call.
      state_shardings: on a mesh, the sharding of every leaf of ``init_state``
        (a restored state is put with it); else None.
      data: the training data the batches are read from (standardised, if the
        config says so).
      model: the ``Model`` the step trains (LoRA adapters over a frozen base, if
        the config says so).
      sampler: the run's sampler (Poisson, padded; or shuffled).
      plan: the ``NoisePlan``: ``noise_multiplier`` (``calibrated`` or given),
        the ``budget``, ``sampling_prob``, ``count_noise_stddev``.
      clipping: ``grad_fn.explain(...)`` for this run's batches: the clip
        method requested, the one used, why, and the rule for each parameter.
      feature_stats: the standardisation statistics, or None.
      keys: the run's ``RunKeys`` (secret unless reproducible; process 0's in
        a run of several processes).
      notes: what was done to the inputs that the run says in its log (starting
        parameters cast to the model's dtypes); public: functions of the config
        and the starting point, never of the private data.
    """

    step_fn: Any
    fn: PrivateStepFn
    example_args: tuple
    init_state: dict[str, Any]
    state_shardings: dict[str, Any] | None
    data: Dataset
    model: Model
    sampler: Any
    plan: NoisePlan
    clipping: dict[str, Any]
    feature_stats: FeatureStats | None
    keys: RunKeys
    notes: tuple[str, ...] = ()

    def batch(self, sampled) -> tuple[Any, Any]:
        """The ``(batch, is_padding_example)`` arguments of ``step_fn`` for a sampled
        batch, read from the training data (on a mesh: split over its devices,
        each process reading only its own rows)."""
        chunk = None if self.fn.chunked is None else self.fn.chunked.size
        return _step_batch(self.data, sampled, self.fn.mesh, chunk)

    def __iter__(self):  # ``step_fn, example_args = build_private_step(...)``
        return iter((self.step_fn, self.example_args))

    def starting_from(self, state: dict[str, Any]) -> PrivateStep:
        """This step with ``state`` (a resumed run's) for its initial state and in
        its ``example_args``: the state built at the start is no longer held."""
        _, batch, pad, _, _ = self.example_args
        args = (state["params"], batch, pad, state["opt_state"], state["loss_scale"])
        return dataclasses.replace(self, init_state=dict(state), example_args=args)


def _make_optimizer(config: Config) -> optax.GradientTransformation:
    t = config.training
    if t.optimizer == "adam":
        return optax.adam(t.learning_rate)
    if t.optimizer == "momentum":
        return optax.sgd(t.learning_rate, momentum=0.9)
    return optax.sgd(t.learning_rate)


def _make_loss_scale(config: Config, key) -> Any:
    ls = config.loss_scale
    if ls.kind == "none":
        return NoOpLossScale()
    if ls.kind == "static":
        return StaticLossScale(ls.initial)
    if ls.kind == "private_dynamic":
        return PrivateDynamicLossScale(
            ls.initial,
            key,
            count_noise_stddev=ls.count_noise_stddev,
            period=ls.period,
            factor=ls.factor,
            min_scale=ls.min_scale,
            max_scale=ls.max_scale,
        )
    return DynamicLossScale(
        ls.initial,
        period=ls.period,
        factor=ls.factor,
        min_scale=ls.min_scale,
        max_scale=ls.max_scale,
    )


def _step_batch(data: Dataset, sampled, mesh: DataParallelMesh | None, chunk: int | None):
    """``PrivateStep.batch``: numpy arrays on one device, global arrays on a mesh."""
    if mesh is None:
        return gather(data, sampled)

    def rows(start, stop):  # every field of the sampled batch has a row per example
        return gather(data, type(sampled)(*(field[start:stop] for field in sampled)))

    return mesh.put_batch(rows, len(sampled.is_padding_example), chunk)


def _standardized(config: Config, data: Dataset, feature_stats, seed: int):
    """``(data, feature_stats)``: the data standardised as ``data.standardize`` says."""
    if config.data.standardize == "none":
        return data, feature_stats
    if not data.in_memory:
        raise ConfigError(
            f"data.standardize: {config.data.standardize!r} needs the features in memory "
            "as float32 arrays; memory-mapped or streamed data must come standardised"
        )
    if feature_stats is None:
        feature_stats = compute_feature_stats(config, data, seed)
    return standardize(data, feature_stats), feature_stats


def _trained_model(
    config: Config, model: Model, init_params, init_key, shards: int, donate: bool = False
):
    """``(model, params_shape, notes)``: the model starting from ``init_params`` (or
    adapting them, with LoRA), the shapes of what trains, checked to fit in memory
    (by a step that donates its state, or not), and what starting from them did."""
    lora = bool(config.model.lora_rank)
    params_shape = jax.eval_shape(model.init, init_key)
    _check_fits(config, params_shape, trainable=not lora, shards=shards, donate=donate)
    model, notes = _starting_point(config, model, init_params, params_shape, init_key)
    if lora:  # the adapters are what trains (init_params have the model's own shapes)
        params_shape = jax.eval_shape(model.init, init_key)
        _check_fits(config, params_shape, trainable=True, shards=shards, donate=donate)
    return model, params_shape, notes


def _mesh_of(config: Config) -> DataParallelMesh | None:
    """The run's mesh (``training.devices``); ``training.shard_params`` needs one."""
    mesh = make_mesh(config)
    if config.training.shard_params and mesh is None:
        raise ConfigError(
            "training.shard_params: shards over a mesh of several devices; set "
            'training.devices to more than 1 (or "all" with several devices)'
        )
    return mesh


def build_private_step(
    config: Config,
    data: Dataset | None = None,
    *,
    model: Model | None = None,
    keys: RunKeys | None = None,
    feature_stats: FeatureStats | None = None,
    init_params: Any = None,
    donate: bool = False,
) -> PrivateStep:
    """The private step of ``config`` and real arguments for it.

    ``step_fn, example_args = build_private_step(config)`` unpacks it; the
    precision audit of a config is
    ``dpmp.audit_precision(step_fn, *example_args, policy=config.precision,
    params_argnums=0, batch_argnums=1)`` (``audit_step`` does exactly this).

    Args:
      config: a ``dpmp`` run ``Config``.
      data: a ``Dataset`` (not standardised); default
        ``load_data(config.data, seed)``.
      model: a ``Model`` (``dpmp.models._adapters.as_model`` makes one of a flax,
        Equinox or plain-JAX model); default ``model_from_config(config.model, ...)``,
        or with ``model.kind = "gpt2"`` the checkpoint's model, parameters and
        tokenizer (``dpmp.app.published.start_from_checkpoint``).
      keys: the run's noise keys and seeds; default ``run_keys(config)``
        (fresh OS entropy unless ``privacy.reproducible_noise``).
      feature_stats: standardisation statistics to reuse (a resumed run's);
        default: computed as ``data.standardize`` says.
      init_params: parameters to start from (pre-trained ones, in the
        structure of the model's ``init``, or the path of a ``.safetensors``
        file or an orbax checkpoint directory of them, named by their paths
        joined by ``.``) instead of its initialisation; with
        ``model.lora_rank`` the frozen base the adapters adapt (default: the
        model's initialisation).
      donate: the step writes the new parameters and optimizer state into the
        buffers of the ones it is given (``dpmp.private_step``'s ``donate``);
        the initial state is the step's own (``model.init``'s output, never
        ``init_params`` themselves), deleted at its first call.
    """
    policy = config.precision
    t = config.training
    if config.model.kind in CHECKPOINT_KINDS and model is None and init_params is None:
        start = start_from_checkpoint(config, model=None, init_params=None, data=data)
        data, model, init_params = start.data, start.model, start.init_params
    if data is None:
        data = load_data(config.data, t.seed)
    keys = shared_keys(run_keys(config) if keys is None else keys)
    mesh = _mesh_of(config)
    devices = mesh.size if mesh else 1
    data, feature_stats = _standardized(config, data, feature_stats, keys.standardize_seed)
    if model is None:
        model = model_from_config(config.model, data, policy)
    init_key = jax.random.split(jax.random.key(t.seed), 3)[0]
    shards = devices if t.shard_params else 1
    model, params_shape, notes = _trained_model(
        config, model, init_params, init_key, shards, donate
    )
    users = _users(config, data)
    sampler = make_sampler(config, data.num_train, keys.sampler_seed, devices, users)
    plan = noise_plan(
        config,
        num_train=sampler.num_examples,  # the users, or the kept records (user_sampling)
        params_shape=params_shape,
        truncation_probability=_truncation_bound(config, sampler),
        num_units=units(config, data),
    )
    per_user = users is not None and config.privacy.user_sampling == "users"
    grad_fn = _grad_fn(config, model, per_user=per_user)
    params = jax.jit(model.init)(init_key)
    size = t.physical_batch_size
    first = sampler.batch(0)
    # what one call of private_grad sees: a chunk, or a device's share of it
    per_call = (size or len(first.indices)) // devices
    explained_batch = jax.tree.map(lambda v: jnp.asarray(v[:per_call]), gather(data, first)[0])
    clipping = _explain_clipping(grad_fn, params, explained_batch, *model.frozen_args())
    fn = private_step(
        grad_fn,
        _make_optimizer(config),
        params=params,
        batch=explained_batch,
        noise_multiplier=plan.noise_multiplier,
        noise_key=keys.noise,
        expected_batch_size=t.expected_batch_size,
        padded_batch_size=sampler.padded_batch_size,
        noise_sampler=config.privacy.noise_sampler,
        physical_batch_size=size,
        mesh=mesh,
        shard_params=t.shard_params,
        frozen=model.frozen,  # an argument of the compiled step, never a constant in it
        donate=donate,
        # correlated noise: the mechanism's strategy for the run's steps (None: DP-SGD)
        strategy=mechanism(config.privacy.mechanism).strategy(t.steps, config.privacy.bands),
    )
    state = fn.init(params, _make_loss_scale(config, keys.loss_scale))
    init_state, shardings = state._asdict(), fn.state_shardings(state)
    batch, pad = jax.tree.map(jnp.asarray, _step_batch(data, first, mesh, size))
    return PrivateStep(
        step_fn=fn.step_fn,
        fn=fn,
        example_args=(
            init_state["params"],
            batch,
            pad,
            init_state["opt_state"],
            init_state["loss_scale"],
        ),
        init_state=init_state,
        state_shardings=None if shardings is None else shardings._asdict(),
        data=data,
        model=model,
        sampler=sampler,
        plan=plan,
        clipping=clipping,
        feature_stats=feature_stats,
        keys=keys,
        notes=notes,
    )


def _grad_fn(config: Config, model: Model, *, per_user: bool):
    """The clipped-sum function: per example, or per user (``user_private_grad``)."""
    return (user_private_grad if per_user else private_grad)(
        model.loss_fn,
        l2_clip_norm=config.privacy.l2_clip_norm,
        policy=config.precision,
        microbatch_size=config.training.microbatch_size,
        allow_nonprivate_loss_scale=config.loss_scale.kind == "nonprivate_dynamic",
        method=config.privacy.clip_method,
    )


def _users(config: Config, data: Dataset):
    """The users of the training records with ``privacy.unit = "user"`` (None at
    record level); data without users is refused in one line."""
    if config.privacy.unit != "user":
        return None
    if data.users_train is None:
        raise ConfigError(
            'privacy.unit: "user" needs a user id per training record: set data.user_field '
            "(a JSONL field, an npz array), or give users= to dpmp.Dataset.from_arrays or "
            "from_tokens"
        )
    return data.users_train


def _truncation_bound(config: Config, sampler) -> float:
    """A bound on the sampler's truncation probability per step that does not
    depend on how its padded size was rounded for the devices or chunks (so that
    1 and 4 devices plan alike): the bound its padded size was chosen for."""
    if not sampler.poisson:
        return 0.0
    bound = max_truncation_prob(config)
    if sampler.truncation_probability > bound:
        raise ConfigError(
            f"the Poisson sampler's padded size {sampler.padded_batch_size} truncates a step "
            f"with probability {sampler.truncation_probability:.3g}, above {bound:.3g}"
        )
    return bound


def _device_bytes(tree: Any) -> int:
    """Bytes of ``tree``'s arrays on the first device that holds a part of them."""
    total = 0
    for a in jax.tree.leaves(tree):
        if isinstance(a, jax.Array) and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            shards = a.addressable_shards
            device = shards[0].device
            total += sum(s.data.nbytes for s in shards if s.device == device)
        else:
            total += getattr(a, "nbytes", 0)
    return total


def _compiled_bytes(fn, *args) -> int:
    """Arguments + outputs + temporaries - aliases of ``fn`` compiled for ``args``, on
    one device (the compilation is cached: the step's first call reuses it)."""
    m = fn.lower(*args).compile().memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def step_memory(step: PrivateStep) -> int:
    """Bytes one device needs for one step of ``step``, from its compiled programs.

    The whole step: its arguments, outputs and temporaries (clipping, the noise
    stage, the optimizer). With physical chunks, the larger of a chunk's call and
    the noise-and-update call, each with the state that stays on the device
    beside it (the optimizer state during the chunks, the whole batch)."""
    params, batch, pad, opt_state, scale = step.example_args
    chunked = step.fn.chunked
    if chunked is None:
        return _compiled_bytes(step.step_fn, *step.example_args)
    chunk, chunk_pad = next(iter(chunked.chunks(batch, pad)))
    acc = chunked.zeros()
    beside = _device_bytes((batch, pad))
    chunk_call = _compiled_bytes(chunked.chunk_fn, params, chunk, chunk_pad, _static(scale), acc)
    apply_call = _compiled_bytes(chunked.apply_fn, params, acc, opt_state, scale, jnp.int32(0))
    return max(chunk_call + _device_bytes(opt_state), apply_call) + beside


def check_step_memory(step: PrivateStep, limit: int | None = None) -> int:
    """``step_memory(step)``, or a ``ConfigError`` in one line when it exceeds
    ``limit`` (default: the first device's memory)."""
    need = step_memory(step)
    limit = _memory_bytes() if limit is None else limit
    if need > limit:
        knobs = (
            "training.physical_batch_size"
            if step.fn.chunked is not None
            else "training.expected_batch_size or training.physical_batch_size"
        )
        raise ConfigError(
            f"the private step needs {need / 2**30:,.2f} GiB per device (compiled: parameters, "
            f"optimizer state, batch, clipping, noise and update) and this device has "
            f"{limit / 2**30:,.2f} GiB; lower {knobs}, or the model's size"
        )
    return need


# The optimizer's slots per trained parameter (Adam: two moments; momentum: one).
_SLOTS = {"adam": 2, "momentum": 1, "sgd": 0}


def _copies(optimizer: str, donate: bool) -> int:
    """What a trained parameter costs in a step at least, itself included: the
    optimizer's slots beside it, and unless the step is donating (the trainer's is)
    the new parameters and slots beside the old. Its clipped sum, noise and update
    are not counted: XLA consumes them a leaf at a time (compiled Adam steps in
    float32, benchmarks/donation.py: 2.9M parameters 4.65 copies donating, 6.53
    not; 104M parameters 3.53 and 6.17). A lower bound from shapes alone;
    ``check_step_memory`` measures the compiled step."""
    state = 1 + _SLOTS.get(optimizer, 1)
    return state if donate else 2 * state


def _memory_bytes() -> int:
    """The first device's memory (its allocator's limit), or the host's RAM."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_fits(
    config: Config, shapes: Any, *, trainable: bool, shards: int = 1, donate: bool = False
) -> None:
    """Refuses parameters (with their gradients and optimizer state when
    ``trainable``, split over ``shards`` devices) that cannot fit in memory, from
    shapes alone: a typo such as ``model.dim = 100000000000`` is one line, not an
    out-of-memory crash."""
    count, need = count_params(shapes), count_bytes(shapes)
    if trainable:
        need = need * _copies(config.training.optimizer, donate) // shards
    limit = _memory_bytes()
    if need <= limit:
        return
    m = config.model
    fields = f"model.lora_rank = {m.lora_rank}" if trainable and m.lora_rank else _sized_by(m)
    what = "with gradients and optimizer state " if trainable else ""
    raise ConfigError(
        f"{fields}: {count:,} parameters need {need / 2**30:,.1f} GiB {what}and this "
        f"machine has {limit / 2**30:,.1f} GiB"
    )


def _sized_by(m: Any) -> str:
    """The ``[model]`` keys that set the size of ``model.kind`` (its family's
    ``sizes``) with their values, or ``model.kind`` itself where none does."""
    family = FAMILIES.find(m.kind)
    keys = () if family is None else family.sizes
    shown = (f"model.{k} = {_listed(getattr(m, k))}" for k in keys)
    return ", ".join(shown) or f"model.kind = {m.kind!r}"


def _listed(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _starting_point(
    config: Config, model: Model, init_params: Any, like: Any, init_key
) -> tuple[Model, tuple[str, ...]]:
    """``model`` starting from ``init_params``, or adapting them frozen (LoRA), and
    what that cast (``_cast_note``); ``like``: the shapes of ``model.init``. A
    frozen base keeps its own dtypes (a bfloat16 base stays bfloat16); parameters
    that train become float32 masters."""
    notes: tuple[str, ...] = ()
    if init_params is not None:
        init_params = _arranged(init_params, like)
        _check_like(init_params, like)
        if not config.model.lora_rank:  # in the dtypes of the model's own parameters
            notes = _cast_note(init_params, like)
            init_params = jax.tree.map(lambda a, b: jnp.asarray(a, b.dtype), init_params, like)
    if config.model.lora_rank:
        base = jax.jit(model.init)(init_key) if init_params is None else init_params
        try:
            m = config.model
            adapted = lora_model(
                model, base, rank=m.lora_rank, alpha=m.lora_alpha, targets=m.lora_targets
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return adapted, notes
    if init_params is None:
        return model, notes
    return dataclasses.replace(model, init=lambda key: init_params), notes


def _cast_note(params: Any, like: Any) -> tuple[str, ...]:
    """One line saying which of ``params``' arrays are cast to ``like``'s dtypes (a
    float16 file for a float32 model: its values are kept, the precision they
    were stored with is all they have), or none when nothing is cast."""
    pairs = [
        (np.dtype(a.dtype).name, np.dtype(b.dtype).name)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(like), strict=True)
    ]
    casts = collections.Counter(pair for pair in pairs if pair[0] != pair[1])
    if not casts:
        return ()
    what = ", ".join(f"{n} from {a} to {b}" for (a, b), n in sorted(casts.items()))
    return (
        f"starting parameters: {sum(casts.values())} of {len(pairs)} arrays cast to the "
        f"model's parameter dtypes ({what})",
    )


def _arranged(params: Any, like: Any) -> Any:
    """``params`` in the structure of ``like``: a path (a ``.safetensors`` file or an
    orbax checkpoint directory) read, a tree of other containers (a file's nested
    dicts) rearranged by parameter name, or ``params`` as they are."""
    if isinstance(params, str | os.PathLike):
        return load_params_file(params, like)
    if jax.tree.structure(params) != jax.tree.structure(like):
        return arrange(param_names(params), like)
    return params


def _check_like(params: Any, like: Any) -> None:
    got, want = jax.tree.structure(params), jax.tree.structure(like)
    if got != want:
        raise ValueError(
            f"init_params: not the model's parameter structure:\n{got}\nexpected\n{want}"
        )
    for i, (a, b) in enumerate(zip(jax.tree.leaves(params), jax.tree.leaves(like))):
        if tuple(a.shape) != tuple(b.shape):
            raise ValueError(
                f"init_params: leaf {i} has shape {tuple(a.shape)}, the model's {tuple(b.shape)}"
            )


def _explain_clipping(grad_fn, params, batch, *frozen) -> dict[str, Any]:
    """Which clip method the step uses; ``method="ghost"`` on an unsupported model is a
    ``ConfigError`` naming the parameter (before any work)."""
    try:
        return grad_fn.explain(params, batch, *frozen)
    except ValueError as e:
        raise ConfigError(f"privacy.clip_method: {e}") from None


def _expected_sites(step: PrivateStep) -> tuple[str, ...]:
    """The sites the step's audit must find: on a mesh, the all-reduce too."""
    return AUDIT_EXPECT + (() if step.fn.mesh is None else ("all_reduce",))


def audit_step(config: Config, data: Dataset | None = None, *, step: PrivateStep | None = None):
    """Precision audit (``dpmp.audit_precision``) of the config's private step."""
    step = build_private_step(config, data) if step is None else step
    return audit_precision(
        step.step_fn,
        *step.example_args,
        policy=config.precision,
        params_argnums=0,
        batch_argnums=1,
        expect=_expected_sites(step),
        name=f"private step ({step.model.name}, {config.policy}"
        + ("" if step.fn.mesh is None else f", {step.fn.mesh.size} devices")
        + ")",
    )


def privacy_audit_step(
    config: Config,
    data: Dataset | None = None,
    *,
    num_releases: int = 1_000_000,
    step: PrivateStep | None = None,
):
    """Empirical privacy audit (``dpmp.privacy_audit``) of the config's noise stage:
    its policy, noise multiplier (calibrated as the run would), sensitivity (the clip
    norm with the rounding bound of the clipped sum) and delta."""
    step = build_private_step(config, data) if step is None else step
    return privacy_audit(
        step.plan.noise_multiplier,
        policy=config.precision,
        clip_norm=step.fn.sensitivity["sensitivity"],
        delta=config.privacy.delta,
        num_releases=num_releases,
        mechanism=sampler(config.privacy.noise_sampler),
    )


def audit_summary(config: Config, step: PrivateStep) -> dict[str, Any]:
    """The precision audit of ``config``'s ``step`` as the report gives it; an audit
    error never stops a run."""
    try:
        report = audit_step(config, step=step)
    except Exception as e:  # the audit must never take the run down
        return {"ok": None, "error": f"{type(e).__name__}: {e}"}
    return {
        "ok": report.ok,
        "violations": [f.to_dict() for f in report.violations],
        "missing": list(report.missing),
        "counts": report.counts(),
        "expect": list(_expected_sites(step)),
    }
