"""The default run, made reproducible, computes what it computed when it was pinned.

The run (``configs/default.toml`` with ``privacy.reproducible_noise = true``, 300
steps) is read only from its last checkpoint's ``.npz`` (the documented checkpoint
format), so this test depends on no internal module. It holds three properties:

* Determinism: two runs in one process give the same bits, parameters, optimizer
  state and keys: what ``reproducible_noise`` promises on one machine.
* The sampling: the 300 Poisson-sampled batches hold ``EXAMPLES`` examples in all
  (integer draws from ``training.seed``, the same on every machine).
* The parameters: at pinned positions of each leaf, the values recorded for the
  run, within ``ENTRY_TOLERANCE`` of the leaf's root mean square.

Why not the bits: float32 sums round differently on different CPUs (vector width,
fused multiply-add), and a 300-step run has no rounding bound to derive. A step's
snapped release depends on its gradient sum only through the grid cell it rounds
to, so most rounding differences vanish, but a cell that flips changes every later
step. Measured: the same run with per-example clipping instead of ghost clipping
(the same sums, added in another order) ends within 0.8% of each leaf's RMS at
every entry (9.5e-4 in relative L2); another seed moves a typical entry by 90% of
it. A change of what a step computes (sampling, clipping, summation, noise, the
optimizer) moves the entries as another draw does.
"""

import json
from pathlib import Path

import numpy as np
import pytest

import dpmp

_CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# Recorded on x86-64 CPU (AMD EPYC, AVX2): flat positions and values of the
# parameter leaves, in the checkpoint's leaf order (Dense_0 bias and kernel, Dense_1
# bias and kernel), and the examples of all 300 sampled batches.
PINNED = (
    (
        (0, 42, 84, 126, 168, 210),
        (0.030588, 0.0489775, -0.00772162, 0.128133, -0.103785, 0.0128307),
    ),
    (
        (0, 2730, 5460, 8190, 10920, 13650),
        (-0.137479, -0.138022, -0.0935424, -0.0456675, -0.110424, 0.1611),
    ),
    ((0, 1, 2, 3, 4, 5), (-0.0122885, 0.0240712, -0.140099, 0.0731972, 0.177059, -0.102609)),
    (
        (0, 426, 852, 1278, 1704, 2130),
        (-0.110488, -0.171163, -0.0200463, -0.0522146, -0.0530721, 0.222444),
    ),
)
EXAMPLES = 152_918
ENTRY_TOLERANCE = 0.05


def _last_checkpoint(out_dir):
    """The last checkpoint's metadata, all its leaves, and its parameter leaves."""
    last = sorted((out_dir / "checkpoints").glob("checkpoint_*.npz"))[-1]
    with np.load(last, allow_pickle=False) as npz:
        meta = json.loads(str(npz["__meta__"]))
        leaves = {name: npz[name] for name in npz.files if name != "__meta__"}
    start, count = meta["params_leaves"]
    params = [leaves[f"leaf_{i:05d}"] for i in range(start, start + count)]
    return meta, leaves, params


@pytest.mark.slow
def test_default_run_with_reproducible_noise_is_deterministic_and_matches_its_pins(tmp_path):
    config = dpmp.load_config(_CONFIGS / "default.toml", ["privacy.reproducible_noise=true"])
    runs = []
    for name in ("first", "second"):
        dpmp.train(config, out_dir=tmp_path / name, progress=False)
        runs.append(_last_checkpoint(tmp_path / name))
    (meta, leaves, params), (_, again, _) = runs
    assert meta["step"] == 300 and sorted(leaves) == sorted(again)
    for name in leaves:
        assert leaves[name].dtype == again[name].dtype
        assert leaves[name].tobytes() == again[name].tobytes(), name
    assert meta["totals"]["examples"] == EXAMPLES
    assert len(params) == len(PINNED)
    for leaf, (positions, values) in zip(params, PINNED):
        flat = np.asarray(leaf, np.float64).ravel()
        rms = np.sqrt(np.mean(flat**2))
        np.testing.assert_allclose(
            flat[list(positions)], values, rtol=0, atol=ENTRY_TOLERANCE * rms
        )
