"""Fused kernels with one dispatch point: impl = "xla" (jnp reference), "pallas", or "cudnn"."""

from megajax.kernels.attention import attention, attention_reference
from megajax.kernels.flash_attention import BlockSizes, flash_attention
from megajax.kernels.fused_norm import layer_norm_pallas, rms_norm_pallas
from megajax.kernels.norms import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference

__all__ = ["BlockSizes", "attention", "attention_reference", "flash_attention", "layer_norm",
           "layer_norm_pallas", "layer_norm_reference", "rms_norm", "rms_norm_pallas", "rms_norm_reference"]
