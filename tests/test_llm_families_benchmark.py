"""benchmarks/llm_families.py: the published sizes it claims (against transformers'
own models of those configs, built without memory) and a run of its rows at a tiny
size, whose ratios are its rows' own numbers."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "llm_families.py"
# Published parameter counts: Llama-3.2-1B's model card (1.24B; 1,235,814,400 with its
# tied embedding) and Qwen2.5-0.5B's (0.49B; 494,032,768).
PUBLISHED = {"llama": 1_235_814_400, "qwen2": 494_032_768}


def _module():
    """The script as a module; its folder on the path only while it imports (the
    folder holds a ``transformers.py`` that would hide the package)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("llm_families", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def _count(config) -> int:
    return sum(_size(shape) for shape in config.shapes().values())


def _size(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def test_the_published_sizes_are_the_model_cards():
    lf = _module()
    for family, count in PUBLISHED.items():
        assert sum(_size(s) for s in lf.SHAPES[family].shapes().values()) == count


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_each_shape_is_transformers_own_model_of_that_config(family):
    """Every tensor's name and shape as transformers builds the model of the same
    config.json (on the meta device: no memory), tied embeddings included."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from dpmp.models._hf_checkpoint import _hf_name

    lf = _module()
    config = lf.SHAPES[family]
    hf_config = transformers.AutoConfig.for_model(**config.to_json())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    ours = {}
    for name, shape in config.shapes().items():
        shape = tuple(shape)
        ours[_hf_name(name)] = shape[::-1] if name.endswith(".kernel") else shape
    assert ours == theirs


@pytest.mark.slow  # builds and compiles six pairs of steps (about a minute)
def test_a_tiny_run_reports_its_own_ratios(monkeypatch):
    lf = _module()
    for family, config in list(lf.SHAPES.items()):
        tiny = dataclasses.replace(
            config,
            vocab_size=1000,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
        monkeypatch.setitem(lf.SHAPES, family, tiny)
    result = lf.main(["--rows", "lora", "full", "--batch", "2", "--tokens", "8"])
    assert [(r["family"], r["row"]) for r in result["ratios"]] == [
        (f, r) for f in ("llama", "qwen2", "gemma") for r in ("lora", "full")
    ]
    for ratio in result["ratios"]:
        steps = {
            r["step"]: r
            for r in result["rows"]
            if (r["family"], r["row"]) == (ratio["family"], ratio["row"])
        }
        private, base = steps["private"], steps["non-private"]
        assert ratio["memory_ratio"] == round(private["compiled_mb"] / base["compiled_mb"], 3)
        assert ratio["compile_ratio"] == round(private["compile_s"] / base["compile_s"], 2)
        assert private["trainable_params"] == base["trainable_params"]
        if ratio["row"] == "lora":
            assert private["base_params"] == _count(lf.SHAPES[ratio["family"]])
            assert private["trainable_params"] < private["base_params"]
        else:
            assert private["trainable_params"] == _count(lf.SHAPES[ratio["family"]])
