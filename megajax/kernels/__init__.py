"""Fused kernels with one dispatch point: impl = "auto" (pallas on GPUs, xla on CPU: auto.py), "xla" (jnp
reference), "pallas", or "cudnn"."""

from megajax.kernels.attention import (attention, attention_block_backward, attention_block_forward,
                                      attention_reference)
from megajax.kernels.cudnn_attention import as_wide_as_keys
from megajax.kernels.flash_attention import flash_block_backward, flash_block_forward
from megajax.kernels.keep_inputs import keeps_inputs
from megajax.kernels.norms import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference

__all__ = ["as_wide_as_keys", "attention", "attention_block_backward", "attention_block_forward",
           "attention_reference", "flash_block_backward", "flash_block_forward", "keeps_inputs", "layer_norm",
           "layer_norm_reference", "rms_norm", "rms_norm_reference"]
