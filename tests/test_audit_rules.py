"""The precision audit's rule table: a rule registered for a primitive is what the
walker applies to it, registrations do not silently replace each other, and
locations come from JAX's public source-info API in the format parsed."""

import inspect
import re

import jax
import jax.numpy as jnp
import pytest

import dpmp
from dpmp.audit import _source
from dpmp.audit._values import GRAD, NOISE, RNG
from dpmp.audit.rules import Rule, _registry, register, rule_for

F32 = jnp.float32
B = 8


@pytest.fixture
def rule_table(monkeypatch):
    """The rule table, restored after the test (the test registers in a copy)."""
    monkeypatch.setattr(_registry, "RULES", _registry.RULES.copy())
    return _registry.RULES


def _loss(w, x):
    return jnp.sum(x @ w)


def _step(w, x, key):
    """A gradient summed over the examples plus a ``tan`` of uniform random bits:
    heavy-tailed noise drawn without ``erf_inv``, that the built-in rules do not
    know as noise."""
    g = jax.grad(_loss)(w, x)
    noise = jnp.tan(jax.random.uniform(key, g.shape, F32))  # the toy draw
    return w - 0.1 * (g + noise)


def _args():
    w = jnp.ones((4, 2), F32)
    x = jnp.ones((B, 4), F32)
    return w, x, jax.random.key_data(jax.random.key(0))


def _tan_draw(s):
    """Toy ``source`` stage: ``tan`` of random bits is a noise draw."""
    if s.ins[0].has(RNG) and not s.ins[0].has(GRAD):
        s.record("noise_sample", s.in_dtypes[0], None, s.policy.noise, "toy draw (tan)")
        s.flags |= NOISE


def _audit():
    return dpmp.audit_precision(_step, *_args(), policy="fp32", batch_argnums=1)


def test_a_registered_toy_rule_is_what_the_walker_applies(rule_table):
    before = _audit()
    assert not before.of_kind("noise_sample") and not before.of_kind("noise_add"), before
    assert rule_for("tan") == Rule()

    register("tan", source=_tan_draw)
    after = _audit()
    (draw,) = after.of_kind("noise_sample")
    assert (draw.primitive, draw.message, draw.ok) == ("tan", "toy draw (tan)", True)
    lines, first = inspect.getsourcelines(_step)
    line = first + next(i for i, text in enumerate(lines) if "jnp.tan(" in text)
    assert draw.location.endswith(f"test_audit_rules.py:{line}"), draw.location
    # the walker carries the toy's NOISE flag on to the addition to the gradient
    (add,) = after.of_kind("noise_add")
    assert add.ok and add.message == "noise added to the gradient sum", add
    # everything the built-in rules found is still there
    for kind in ("batch_reduction", "update"):
        assert len(after.of_kind(kind)) == len(before.of_kind(kind)) > 0, kind


def test_each_stage_of_a_primitive_is_registered_once(rule_table):
    assert rule_for("erf_inv").source is not None
    with pytest.raises(ValueError, match="'erf_inv'.*source.*already registered"):
        register("erf_inv", source=_tan_draw)
    # another stage of the same primitive is free
    register("erf_inv", gradient=lambda s: None)
    assert rule_for("erf_inv").gradient is not None and rule_for("erf_inv").source is not None
    with pytest.raises(ValueError, match="unknown stage.*allowed: walk, axes"):
        register("tan", draw=_tan_draw)
    # a registration that is refused for one primitive registers for none
    with pytest.raises(ValueError, match="audit rule 'erf_inv': stage.*source.*already registered"):
        register("tan", "erf_inv", source=_tan_draw)
    assert rule_for("tan") == Rule() and "tan" not in rule_table


def test_locations_come_from_the_public_source_info_api():
    """``jax.extend.source_info_util.summarize`` still writes ``file:line[:col] (fn)``:
    if JAX changes it, locations would silently go blank; this fails first."""

    def f(x):
        return jnp.sin(x)

    (eqn,) = jax.make_jaxpr(f)(jnp.ones(3, F32)).jaxpr.eqns
    line = inspect.getsourcelines(f)[1] + 1
    summary = jax.extend.source_info_util.summarize(eqn.source_info)
    pattern = rf"{re.escape(__file__)}:{line}:\d+ \({re.escape(f.__qualname__)}\)"
    assert re.fullmatch(pattern, summary), summary
    assert _source.location(eqn).endswith(f"test_audit_rules.py:{line}"), _source.location(eqn)


def test_the_backward_pass_is_told_by_its_name_stack():
    grad = jax.make_jaxpr(jax.grad(lambda w: jnp.sum(jnp.sin(w))))(jnp.ones(3, F32))
    scopes = {e.primitive.name: _source.in_transpose(e) for e in grad.jaxpr.eqns}
    assert scopes == {
        "sin": False,
        "cos": False,
        "reduce_sum": False,
        "broadcast_in_dim": True,
        "mul": True,
    }


# ---- a scan's constants and carry, in either jax's parameters ---------------------


def test_a_scans_constants_and_carry_are_counted_from_its_own_parameters():
    """jax before 0.11 names them (num_consts, num_carry), jax 0.11 groups its inputs
    (ft_in); either way the counts match the scan written here: two closed-over
    arrays, a carry of two values that both change, one scanned array."""
    from dpmp.audit.rules._control_flow import _scan_counts

    w, v = jnp.arange(3.0), jnp.arange(2.0)

    def f(xs):
        def body(c, x):
            return (c[0] + x * w.sum(), c[1] * v.sum() + x), c[0] * x

        return jax.lax.scan(body, (0.0, 1.0), xs)

    (eqn,) = [e for e in jax.make_jaxpr(f)(jnp.ones(4)).eqns if e.primitive.name == "scan"]
    consts, carry = _scan_counts(eqn.params, len(eqn.invars))
    assert carry == 2
    assert consts == len(eqn.invars) - carry - 1


class _Group(tuple):
    """A stand-in for jax 0.11's flat trees: ``unpack()`` gives the groups, and
    iterating a group gives its values."""

    def unpack(self):
        return tuple(self)


def test_jax_0_11s_grouped_scan_inputs_are_counted_and_a_mismatch_is_named():
    from dpmp.audit.rules._control_flow import _scan_counts

    ft_in = _Group(((None, None, None), (None,), (None, None)))
    assert _scan_counts({"ft_in": ft_in}, 6) == (3, 1)
    with pytest.raises(ValueError, match="does not describe its 5 inputs"):
        _scan_counts({"ft_in": ft_in}, 5)
