"""GPT-2 and Llama style transformers with logical axis names on every parameter."""

from megajax.model.gpt import (GPT, DecodeState, Side, abstract_params, block_apply, block_apply_split,
                               block_tap_shapes, cross_entropy, decode_apply, dropout_keys, embed_apply,
                               embed_tokens, first_dense_apply, forward_loss, head_apply, head_loss, init_decode_state,
                               init_params, layers_apply, layers_unrolled, logical_axes, loss_sum, mtp_batch,
                               scan_layers, side_inputs)
from megajax.model.layers import KEEP_INPUTS, recomputed

__all__ = ["GPT", "KEEP_INPUTS", "DecodeState", "Side", "abstract_params", "block_apply", "block_apply_split",
           "block_tap_shapes", "cross_entropy", "decode_apply", "dropout_keys", "embed_apply",
           "embed_tokens", "first_dense_apply", "forward_loss", "head_apply", "head_loss", "init_decode_state",
           "init_params", "layers_apply", "layers_unrolled", "logical_axes", "loss_sum", "mtp_batch", "recomputed",
           "scan_layers", "side_inputs"]
