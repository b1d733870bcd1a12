"""Models: what the trainer needs of one (``Model``), the built-in families by
name (a registry: ``dpmp.models.families``), adapters for flax linen/nnx,
Equinox and plain-function models, LoRA adapters, GPT-2, Llama, Qwen2 and
Gemma checkpoint folders, generation, and parameters in ``.safetensors`` files or orbax directories.
"""

from dpmp.models._adapters import as_model as as_model
from dpmp.models._generate import generate as generate
from dpmp.models._generate import generate_text as generate_text
from dpmp.models._gpt2_checkpoint import GPT2 as GPT2
from dpmp.models._gpt2_checkpoint import encode_text as encode_text
from dpmp.models._gpt2_checkpoint import load_gpt2 as load_gpt2
from dpmp.models._gpt2_checkpoint import save_gpt2 as save_gpt2
from dpmp.models._hf_checkpoint import Decoder as Decoder
from dpmp.models._hf_checkpoint import GenerationDefaults as GenerationDefaults
from dpmp.models._hf_checkpoint import load_decoder as load_decoder
from dpmp.models._hf_checkpoint import save_decoder as save_decoder
from dpmp.models._lora import init_adapters as init_adapters
from dpmp.models._lora import merge as merge
from dpmp.models._model import Model as Model
from dpmp.models._params_file import load_params_file as load_params_file
from dpmp.models._params_file import save_params_file as save_params_file
from dpmp.models.families import Architecture as Architecture
from dpmp.models.families import ModelFamily as ModelFamily
from dpmp.models.families import build_model as build_model
from dpmp.models.families import register_family as register_family
from dpmp.models.families._decoder import DecoderConfig as DecoderConfig
from dpmp.models.families._gpt2 import GPT2Config as GPT2Config
from dpmp.models.families._gpt2 import gpt2_model as gpt2_model

__all__ = [
    "GPT2",
    "Architecture",
    "Decoder",
    "DecoderConfig",
    "GenerationDefaults",
    "GPT2Config",
    "Model",
    "ModelFamily",
    "as_model",
    "build_model",
    "encode_text",
    "generate",
    "generate_text",
    "gpt2_model",
    "init_adapters",
    "load_decoder",
    "load_gpt2",
    "load_params_file",
    "merge",
    "register_family",
    "save_decoder",
    "save_gpt2",
    "save_params_file",
]
