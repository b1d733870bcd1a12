"""Run a script on several (forced) CPU host devices: the device count is fixed when
JAX starts, so multi-device checks run in a subprocess."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_on_host_devices(tmp_path, name, source, *, devices=4, timeout=300):
    """Run ``source`` as ``tmp_path / name`` with ``devices`` CPU devices, from the
    repository root (``tests`` importable); return the JSON it prints after ``JSON``."""
    script = tmp_path / name
    script.write_text(source)
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(run.stdout.split("JSON", 1)[1])
