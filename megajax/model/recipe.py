"""What a block is made of, per architecture: one row of `RECIPES` (Megatron-Core's ModuleSpec, as data).

The layers read their parts from `recipe(cfg)` instead of asking which architecture they are in: the norm, how
positions enter (a learned table added to the embedding, or rotary in attention), how queries, keys and values are
made (one fused matmul, or multi-latent attention's low-rank projections), the MLP's activation, and where biases
sit. An architecture that mixes these differently (Qwen2's biases on QKV alone, a GPT-style model with rotary) is a
new row or a config key, not a new branch in the layers.

| part | gpt2 | llama |
|---|---|---|
| norm | LayerNorm (scale, bias) | RMSNorm (scale) |
| positions | learned table, added to the embedding | rotary, on queries and keys |
| qkv | one fused matmul [d, g, r + 2, k] (or latent with model.multi_latent_attention) | the same |
| qkv_bias | yes | model.add_qkv_bias |
| mlp | GeLU, [d, f] in | SwiGLU, gate and up fused [d, 2, f] in |
| bias | attention out, MLP in and out (and the experts') | none |
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

from megajax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Recipe:
    norm: Literal["layer_norm", "rms_norm"]
    positions: Literal["learned", "rotary"]
    qkv: Literal["fused", "latent"]
    qkv_bias: bool
    mlp: Literal["gelu", "swiglu"]
    bias: bool  # the attention output's, the MLP's (and every expert's) input and output biases

    @property
    def learned_positions(self) -> bool:
        return self.positions == "learned"

    @property
    def rotary(self) -> bool:
        return self.positions == "rotary"


RECIPES = {
    "gpt2": Recipe(norm="layer_norm", positions="learned", qkv="fused", qkv_bias=True, mlp="gelu", bias=True),
    "llama": Recipe(norm="rms_norm", positions="rotary", qkv="fused", qkv_bias=False, mlp="swiglu", bias=False),
}


@functools.lru_cache(maxsize=None)
def recipe(cfg: ModelConfig) -> Recipe:
    """The parts of `cfg`'s blocks: its architecture's row, with the config's own choices on top."""
    row = RECIPES[cfg.arch]
    return dataclasses.replace(row, qkv="latent" if cfg.multi_latent_attention else row.qkv,
                               qkv_bias=row.qkv_bias or cfg.add_qkv_bias)
