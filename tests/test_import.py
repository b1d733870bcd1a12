"""Importing dpmp does no work: no arrays, no backend."""

import subprocess
import sys

import pytest

import dpmp


def test_import_starts_no_backend_and_creates_no_arrays():
    code = (
        "import jax, jax._src.xla_bridge as xb\n"
        "import dpmp, dpmp.accounting\n"
        "assert not xb._backends, xb._backends\n"
        "import gc, jax\n"
        "arrays = [o for o in gc.get_objects() if isinstance(o, jax.Array)]\n"
        "assert not arrays, arrays\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_every_public_name_imports():
    assert len(dpmp.__all__) == len(set(dpmp.__all__))
    for name in dpmp.__all__:
        assert getattr(dpmp, name) is not None, name


@pytest.mark.slow  # ~5 s on 2 cores
def test_help_and_import_load_no_jax():
    """``dpmp --help`` (each command's too) and ``import dpmp`` import neither JAX
    nor dp-accounting: the public names load on first use (``dpmp budget --help``
    lists the registered accountants by name, which loads none of them)."""
    code = (
        "import sys\n"
        "import dpmp\n"
        "from dpmp import cli\n"
        "def help(*argvs):\n"
        "    for argv in argvs:\n"
        "        try:\n"
        "            cli.main(argv)\n"
        "        except SystemExit:\n"
        "            pass\n"
        "    return [m for m in ('jax', 'dp_accounting', 'flax', 'numpy') if m in sys.modules]\n"
        "heavy = help(['--help'], ['train', '--help'], ['audit', '--help'],\n"
        "            ['compare', '--help'], ['report', '--help'], ['budget', '--help'],\n"
        "            ['--version'])\n"
        "assert not heavy, heavy\n"
        "assert dpmp.Config().training.steps == 300  # and the names still work\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


# The public names of ``dpmp`` and ``dpmp.accounting`` before the package was
# reorganised into layers: each one still imports, from the same place.
NAMES_BEFORE_LAYERS = (
    "AUDIT_KINDS",
    "Config",
    "ConfigError",
    "DataError",
    "Dataset",
    "DynamicLossScale",
    "Finding",
    "NoOpLossScale",
    "NoiseSharding",
    "NumericReport",
    "PoissonSampler",
    "Policy",
    "PrecisionAuditError",
    "PrecisionError",
    "PrecisionReport",
    "PrivacyAuditReport",
    "PrivateDynamicLossScale",
    "PrivateGrad",
    "PrivateGradFn",
    "PrivateGradStats",
    "RunAuditReport",
    "SampledBatch",
    "ScaledGrad",
    "ShuffledSampler",
    "StaticLossScale",
    "accounting",
    "all_finite",
    "audit_precision",
    "audit_run",
    "cast_function",
    "cast_tree",
    "force_full_precision",
    "fp_sum_sensitivity",
    "gaussian_privatizer",
    "init_lora",
    "load_config",
    "load_params",
    "merge_lora",
    "numeric_audit",
    "privacy_audit",
    "private_grad",
    "private_optimizer",
    "select_tree",
    "snap_grid",
    "snapped_gaussian",
    "train",
    "update_if_finite",
    "value_and_grad",
)
ACCOUNTING_NAMES_BEFORE_LAYERS = (
    "ACCOUNTANTS",
    "BudgetExceededError",
    "BudgetTracker",
    "EpsilonBreakdown",
    "MAX_EPSILON",
    "MAX_NOISE_MULTIPLIER",
    "MAX_STEPS",
    "MIN_CALIBRATED_NOISE",
    "NEIGHBORING_RELATIONS",
    "NoiseResidual",
    "PrivacyBudget",
    "REPORT_DISCRETIZATION",
    "REQUIRED",
    "RESIDUAL_DELTA_SHARE",
    "SNAP_TAIL",
    "TRACKING_DISCRETIZATION",
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "count_releases",
    "dpsgd_event",
    "effective_noise_multiplier",
    "epsilon",
    "epsilon_breakdown",
    "noise_residual",
)


def test_every_name_public_before_the_layers_still_imports():
    import dpmp
    import dpmp.accounting

    missing = [n for n in NAMES_BEFORE_LAYERS if not hasattr(dpmp, n)]
    missing += [
        f"accounting.{n}" for n in ACCOUNTING_NAMES_BEFORE_LAYERS if not hasattr(dpmp.accounting, n)
    ]
    assert not missing, missing
    assert set(NAMES_BEFORE_LAYERS) <= set(dpmp.__all__)
    assert set(ACCOUNTING_NAMES_BEFORE_LAYERS) <= set(dpmp.accounting.__all__)
