"""Fused kernels with one dispatch point: impl = "xla" (jnp reference), "pallas", or "cudnn"."""

from megajax.kernels.attention import attention, attention_reference
from megajax.kernels.norms import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference

__all__ = ["attention", "attention_reference", "layer_norm", "layer_norm_reference", "rms_norm",
           "rms_norm_reference"]
