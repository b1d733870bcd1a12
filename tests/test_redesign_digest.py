"""The default run, made reproducible, trains to the same bits as before the redesign.

The digest below was recorded on main before the package was reorganised into
layers (issue 31): sha256 over each parameter leaf's shape, dtype and bytes, read
straight from the last checkpoint's ``.npz`` (the documented checkpoint format),
so this test depends on no internal module. It fails if any step of the default
run changes what it computes: sampling, clipping, summation, noise, the optimizer.
"""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

import dpmp

_CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# configs/default.toml with privacy.reproducible_noise = true (300 steps), on x86-64 CPU.
DEFAULT_RUN_PARAMS_SHA256 = "2b6223bb7a7a8a7262470c532f50df8315c4215c6451b8bef7dd0738c93cfaba"


def _final_params_digest(out_dir) -> str:
    last = sorted((out_dir / "checkpoints").glob("checkpoint_*.npz"))[-1]
    with np.load(last, allow_pickle=False) as npz:
        meta = json.loads(str(npz["__meta__"]))
        start, count = meta["params_leaves"]
        h = hashlib.sha256()
        for i in range(start, start + count):
            arr = npz[f"leaf_{i:05d}"]
            h.update(f"{arr.shape}{arr.dtype}".encode())
            h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


@pytest.mark.slow
def test_default_run_with_reproducible_noise_is_bit_identical(tmp_path):
    config = dpmp.load_config(_CONFIGS / "default.toml", ["privacy.reproducible_noise=true"])
    dpmp.train(config, out_dir=tmp_path / "run", progress=False)
    assert _final_params_digest(tmp_path / "run") == DEFAULT_RUN_PARAMS_SHA256
