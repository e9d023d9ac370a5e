"""Hugging Face <-> megajax: configs, tensor names and layouts, and the model folders on disk.

Converts GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM and
DeepseekV3ForCausalLM (megajax/hf/configs.py lists what each maps to). Everything is NumPy (ml_dtypes for
bfloat16); torch is never imported. One concept per module, each importing only those above it:

  errors.py   ConversionError, and read_json (a JSON object, or a ConversionError naming the file)
  configs.py  config.json <-> ModelConfig per architecture (model_config_from_hf, hf_config_from_model), and
              which architecture a megajax model converts as (or why none)
  weights.py  the per-architecture weight rules (`rules`: names, shapes, transposes, fused QKV, stacked layers
              and experts) and the conversion of a parameter tree each way (params_from_hf, params_to_hf)
  folders.py  safetensors folders: SafetensorsReader, write_safetensors, parse_size, SIDE_FILES

megajax.convert is the command line that puts them together. `from megajax import hf; hf.X` works for every
public name below.
"""

from megajax.hf.configs import (ARCHITECTURES, DEEPSEEK_BIAS_RATE, hf_arch, hf_config_from_model,
                                model_config_from_hf, read_hf_config)
from megajax.hf.errors import ConversionError, read_json
from megajax.hf.folders import SIDE_FILES, SafetensorsReader, parse_size, write_safetensors
from megajax.hf.weights import Rule, params_from_hf, params_to_hf, rules

__all__ = ["ARCHITECTURES", "DEEPSEEK_BIAS_RATE", "SIDE_FILES", "ConversionError", "Rule", "SafetensorsReader",
           "hf_arch", "hf_config_from_model", "model_config_from_hf", "params_from_hf", "params_to_hf",
           "parse_size", "read_hf_config", "read_json", "rules", "write_safetensors"]
