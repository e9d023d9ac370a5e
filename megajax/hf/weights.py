"""Hugging Face tensors <-> the megajax parameter tree: the weight rules (names, shapes, transposes, fused
QKV, stacked layers and experts) and the conversion of a whole model each way (`params_from_hf`, `params_to_hf`).
Everything here is NumPy (ml_dtypes for bfloat16); torch is never imported.

One table per architecture (`rules`) says, for every megajax parameter, which HF tensors it is made of
and how to go each way. The layouts differ in five places:
  - QKV: megajax fuses it grouped by kv head, [d, g, r + 2, k] (each kv head's r query heads, then its
    key, then its value: Megatron's layout); GPT-2 fuses it as [d, q | k | v] (Conv1D, in x out), Llama
    keeps q_proj [h k, d], k_proj and v_proj [g k, d] apart (nn.Linear, out x in).
  - Llama's gate and up projections are fused as [d, 2, f]; Mixtral's experts (w1 gate, w3 up, w2 down, one
    tensor per expert; Qwen2-MoE's gate_proj, up_proj, down_proj) are stacked as [e, d, f, 2] and [e, f, d], the
    router (gate) is [d, e]; Qwen's QKV biases are fused as the weights are, [g, r + 2, k].
  - Layers are stacked on a leading axis ('layers') instead of one tensor per layer (DeepSeek's dense first
    layers are not: 'first_dense/layer_j').
  - DeepSeek's RoPE dimensions are interleaved pairs in HF, halves in megajax (`_latent_attention_rules`).
  - The vocabulary is padded to model.padded_vocab_size: zero rows on import, dropped on export.

Which architecture a config converts as, and the config.json that goes with it, is megajax/hf/configs.py.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any

import ml_dtypes  # bfloat16 for NumPy (_np_dtype); importing it also registers the dtype with NumPy
import numpy as np

from megajax.config import ModelConfig
from megajax.hf.configs import require_convertible
from megajax.hf.errors import ConversionError

# Buffers some checkpoints carry that are not weights (GPT-2's causal mask, old Llama's RoPE frequencies).
_BUFFERS = {"gpt2": re.compile(r"(^|\.)attn\.(bias|masked_bias)$"), "llama": re.compile(r"rotary_emb\.inv_freq$")}


@dataclasses.dataclass(frozen=True)
class Rule:
    """One megajax parameter and the HF tensors it is made of ('{i}' in a name: the layer index)."""

    path: tuple[str, ...]
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]  # the HF shapes the config implies, one per name
    to_megajax: Callable[..., np.ndarray]  # HF tensors (one layer) -> megajax array (one layer)
    to_hf: Callable[[np.ndarray], tuple[np.ndarray, ...]]

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.names[0]


def _same(path, name, shape) -> Rule:
    return Rule(path, (name,), (shape,), lambda w: w, lambda x: (x,))


def _transposed(path, name, shape) -> Rule:
    return Rule(path, (name,), (shape,), lambda w: w.T, lambda x: (x.T,))


def _vocab_rules(cfg: ModelConfig, embed_name: str) -> list[Rule]:
    """Embedding [v, d] and untied output layer (HF [v, d], megajax [d, v]), zero-padded to v_padded."""
    v, d, pad = cfg.vocab_size, cfg.hidden_size, cfg.padded_vocab_size - cfg.vocab_size

    def padded(w):
        return np.concatenate([w, np.zeros((pad, d), w.dtype)]) if pad else w

    rules = [Rule(("embed", "embedding"), (embed_name,), ((v, d),), padded, lambda x: (x[:v],))]
    if not cfg.tied:
        rules.append(Rule(("head", "output"), ("lm_head.weight",), ((v, d),), lambda w: padded(w).T,
                          lambda x: (x.T[:v],)))
    return rules


def _gpt2_rules(cfg: ModelConfig) -> list[Rule]:
    d, h, k, f = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.ffn_size
    p = "transformer.h.{i}."
    blk = ("layers", "block")
    # GPT-2's Conv1D weights are [in, out]; c_attn's output is [q heads | k heads | v heads]. With g = h
    # and r = 1, megajax's group j is (q head j, k head j, v head j): a transpose of the (3, h) axes.
    wqkv = Rule(blk + ("attn", "wqkv"), (p + "attn.c_attn.weight",), ((d, 3 * d),),
                lambda w: w.reshape(d, 3, h, k).transpose(0, 2, 1, 3),
                lambda x: (x.transpose(0, 2, 1, 3).reshape(d, 3 * d),))
    bqkv = Rule(blk + ("attn", "bqkv"), (p + "attn.c_attn.bias",), ((3 * d,),),
                lambda w: w.reshape(3, h, k).transpose(1, 0, 2), lambda x: (x.transpose(1, 0, 2).reshape(3 * d),))
    wo = Rule(blk + ("attn", "wo"), (p + "attn.c_proj.weight",), ((d, d),),
              lambda w: w.reshape(h, k, d), lambda x: (x.reshape(h * k, d),))
    return [
        *_vocab_rules(cfg, "transformer.wte.weight"),
        _same(("embed", "position_embedding"), "transformer.wpe.weight", (cfg.seq_length, d)),
        _same(blk + ("attn_norm", "scale"), p + "ln_1.weight", (d,)),
        _same(blk + ("attn_norm", "bias"), p + "ln_1.bias", (d,)),
        wqkv, bqkv, wo,
        _same(blk + ("attn", "bo"), p + "attn.c_proj.bias", (d,)),
        _same(blk + ("mlp_norm", "scale"), p + "ln_2.weight", (d,)),
        _same(blk + ("mlp_norm", "bias"), p + "ln_2.bias", (d,)),
        _same(blk + ("mlp", "w_in"), p + "mlp.c_fc.weight", (d, f)),
        _same(blk + ("mlp", "b_in"), p + "mlp.c_fc.bias", (f,)),
        _same(blk + ("mlp", "w_out"), p + "mlp.c_proj.weight", (f, d)),
        _same(blk + ("mlp", "b_out"), p + "mlp.c_proj.bias", (d,)),
        _same(("head", "final_norm", "scale"), "transformer.ln_f.weight", (d,)),
        _same(("head", "final_norm", "bias"), "transformer.ln_f.bias", (d,)),
    ]


def _llama_rules(cfg: ModelConfig, rope_interleave: bool = True) -> list[Rule]:
    d, h, g, k, f = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.ffn_size
    r = h // g
    p = "model.layers.{i}."
    blk = ("layers", "block")

    # nn.Linear weights are [out, in]. Query head j*r + m belongs to kv head j (HF's repeat_kv order),
    # so q_proj.T reshapes straight into [d, g, r, k].
    def fuse_qkv(q, kk, v):
        return np.concatenate([q.T.reshape(d, g, r, k), kk.T.reshape(d, g, 1, k), v.T.reshape(d, g, 1, k)], axis=2)

    def split_qkv(x):
        return x[:, :, :r].reshape(d, h * k).T, x[:, :, r].reshape(d, g * k).T, x[:, :, r + 1].reshape(d, g * k).T

    attn = p + "self_attn."
    if cfg.multi_latent_attention:
        first = [rule for j in range(cfg.first_dense_layers)
                 for rule in _deepseek_layer_rules(cfg, f"model.layers.{j}.", ("first_dense", f"layer_{j}"), False,
                                                   rope_interleave)]
        return [*_vocab_rules(cfg, "model.embed_tokens.weight"), *first,
                *_deepseek_layer_rules(cfg, p, blk, cfg.num_experts > 0, rope_interleave),
                _same(("head", "final_norm", "scale"), "model.norm.weight", (d,)),
                *[rule for k in range(1, cfg.mtp_num_layers + 1) for rule in _mtp_rules(cfg, k, rope_interleave)]]
    wqkv = Rule(blk + ("attn", "wqkv"), (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                ((h * k, d), (g * k, d), (g * k, d)), fuse_qkv, split_qkv)
    wo = Rule(blk + ("attn", "wo"), (attn + "o_proj.weight",), ((d, h * k),),
              lambda w: w.T.reshape(h, k, d), lambda x: (x.reshape(h * k, d).T,))
    biases = []
    if cfg.add_qkv_bias:  # Qwen: q, k and v biases, fused like the weights
        biases.append(Rule(blk + ("attn", "bqkv"), (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                           ((h * k,), (g * k,), (g * k,)),
                           lambda q, kk, v: np.concatenate([q.reshape(g, r, k), kk.reshape(g, 1, k),
                                                            v.reshape(g, 1, k)], axis=1),
                           lambda x: (x[:, :r].reshape(h * k), x[:, r].reshape(g * k), x[:, r + 1].reshape(g * k))))
    if not cfg.num_experts:
        mlp = _swiglu_rules(blk + ("mlp",), p + "mlp.", d, f)
    elif cfg.moe_shared_experts:
        mlp = _qwen2_moe_rules(cfg)
    else:
        mlp = _mixtral_rules(cfg)
    return [
        *_vocab_rules(cfg, "model.embed_tokens.weight"),
        _same(blk + ("attn_norm", "scale"), p + "input_layernorm.weight", (d,)),
        wqkv, *biases, wo,
        _same(blk + ("mlp_norm", "scale"), p + "post_attention_layernorm.weight", (d,)),
        *mlp,
        _same(("head", "final_norm", "scale"), "model.norm.weight", (d,)),
    ]


def _swiglu_rules(path: tuple[str, ...], prefix: str, d: int, f: int) -> list[Rule]:
    """A SwiGLU MLP: gate_proj and up_proj [f, d] fused as [d, 2, f], down_proj [d, f] as [f, d]."""
    return [Rule(path + ("w_gate_up",), (prefix + "gate_proj.weight", prefix + "up_proj.weight"), ((f, d), (f, d)),
                 lambda gate, up: np.stack([gate.T, up.T], axis=1), lambda x: (x[:, 0].T, x[:, 1].T)),
            _transposed(path + ("w_out",), prefix + "down_proj.weight", (d, f))]


def _expert_rules(cfg: ModelConfig, moe: str, names: tuple[str, str, str],
                  mlp: tuple[str, ...] = ("layers", "block", "mlp")) -> list[Rule]:
    """The router (`moe`gate.weight, [e, d]) and each expert's gate, up [f, d] and down [d, f] projections
    (`names`), one tensor per expert, the way save_pretrained writes them, stacked as [e, d, f, 2] and [e, f, d];
    `mlp`: the megajax path of the layer's MoE."""
    d, f, e = cfg.hidden_size, cfg.moe_ffn_size, cfg.num_experts
    w1, w3, w2 = ([moe + f"experts.{j}.{w}.weight" for j in range(e)] for w in names)
    gate_up = Rule(mlp + ("w_gate_up",), (*w1, *w3), ((f, d),) * (2 * e),
                   lambda *ws: np.stack([np.stack([g.T, u.T], axis=-1) for g, u in zip(ws[:e], ws[e:])]),
                   lambda x: (*(x[j, ..., 0].T for j in range(e)), *(x[j, ..., 1].T for j in range(e))))
    down = Rule(mlp + ("w_out",), tuple(w2), ((d, f),) * e, lambda *ws: np.stack([w.T for w in ws]),
                lambda x: tuple(x[j].T for j in range(e)))
    return [_transposed(mlp + ("router",), moe + "gate.weight", (e, d)), gate_up, down]


def _mixtral_rules(cfg: ModelConfig) -> list[Rule]:
    """Mixtral's block_sparse_moe: experts w1 (gate), w3 (up), w2 (down)."""
    return _expert_rules(cfg, "model.layers.{i}.block_sparse_moe.", ("w1", "w3", "w2"))


def _qwen2_moe_rules(cfg: ModelConfig) -> list[Rule]:
    """Qwen2-MoE's mlp: experts (gate_proj, up_proj, down_proj), the shared expert (a SwiGLU MLP of
    shared_expert_intermediate_size) and its gate [1, d]."""
    moe, mlp, d = "model.layers.{i}.mlp.", ("layers", "block", "mlp"), cfg.hidden_size
    return [*_expert_rules(cfg, moe, ("gate_proj", "up_proj", "down_proj")),
            *_swiglu_rules(mlp + ("shared",), moe + "shared_expert.", d, cfg.moe_shared_experts * cfg.moe_ffn_size),
            Rule(mlp + ("shared_gate",), (moe + "shared_expert_gate.weight",), ((1, d),), lambda w: w[0],
                 lambda x: (x[None],))]


def _deepseek_layer_rules(cfg: ModelConfig, p: str, blk: tuple[str, ...], moe: bool, interleaved: bool) -> list[Rule]:
    """One DeepSeek-V3 layer (`p`: its HF prefix; `blk`: its megajax path), with experts or a dense MLP."""
    d = cfg.hidden_size
    mlp = _deepseek_moe_rules(cfg, p + "mlp.", blk + ("mlp",)) if moe else _swiglu_rules(blk + ("mlp",), p + "mlp.",
                                                                                          d, cfg.ffn_size)
    return [_same(blk + ("attn_norm", "scale"), p + "input_layernorm.weight", (d,)),
            *_latent_attention_rules(cfg, p + "self_attn.", blk + ("attn",), interleaved),
            _same(blk + ("mlp_norm", "scale"), p + "post_attention_layernorm.weight", (d,)), *mlp]


def _mtp_rules(cfg: ModelConfig, k: int, interleaved: bool) -> list[Rule]:
    """DeepSeek-V3's multi-token prediction module k: Hugging Face's layer num_layers + k - 1 (layer 61 of
    DeepSeek-V3), its norms of the embedding (enorm) and of the hidden states (hnorm), eh_proj ([d, 2d], the
    embedding's half first), a decoder layer with experts, and shared_head's norm. Its copies of the embedding and
    output layer (embed_tokens, shared_head.head) are `_mtp_copies`."""
    d, p, own = cfg.hidden_size, f"model.layers.{cfg.num_layers + k - 1}.", (f"mtp_{k}",)
    return [_same(own + ("enorm", "scale"), p + "enorm.weight", (d,)),
            _same(own + ("hnorm", "scale"), p + "hnorm.weight", (d,)),
            _transposed(own + ("eh_proj",), p + "eh_proj.weight", (d, 2 * d)),
            *_deepseek_layer_rules(cfg, p, own + ("block",), cfg.num_experts > 0, interleaved),
            _same(own + ("final_norm", "scale"), p + "shared_head.norm.weight", (d,))]


def _mtp_copies(cfg: ModelConfig) -> dict[str, str]:
    """Each multi-token prediction module's copies of the shared embedding and output layer in a Hugging Face
    folder (DeepSeek-V3 saves both in the module's layer), by the tensor each copies."""
    out = {}
    for k in range(1, cfg.mtp_num_layers + 1):
        p = f"model.layers.{cfg.num_layers + k - 1}."
        out[p + "embed_tokens.weight"] = "model.embed_tokens.weight"
        out[p + "shared_head.head.weight"] = "model.embed_tokens.weight" if cfg.tied else "lm_head.weight"
    return out


def _latent_attention_rules(cfg: ModelConfig, attn: str, blk: tuple[str, ...], interleaved: bool) -> list[Rule]:
    """DeepSeek's MLA projections (nn.Linear [out, in]) as megajax's [in, .., out] weights. Hugging Face keeps the
    RoPE dimensions of q_b_proj (or q_proj) and kv_a_proj_with_mqa interleaved, each pair (2i, 2i + 1) rotated by
    frequency i (rope_interleave); megajax rotates halves (i, i + r / 2), so those output rows are reordered evens
    first on import, and back on export (kept as they are from a source without rope_interleave). The attention
    scores are the same."""
    d, h, n, r, v = cfg.hidden_size, cfg.num_heads, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    c = cfg.kv_lora_rank
    halves = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)]) if interleaved else np.arange(r)
    pairs = np.argsort(halves)  # halves -> interleaved

    def reorder(x, order):  # the last axis's RoPE dimensions (its last r) in `order`
        return np.concatenate([x[..., :-r], x[..., -r:][..., order]], axis=-1)

    def heads(name, hf_name, rank):  # [h (n + r), rank] -> [rank, h, n + r], RoPE dims in halves; and back
        return Rule(blk + (name,), (attn + hf_name,), ((h * (n + r), rank),),
                    lambda w: reorder(w.T.reshape(rank, h, n + r), halves),
                    lambda x: (reorder(x, pairs).reshape(rank, -1).T,))

    out = [Rule(blk + ("wkv_down",), (attn + "kv_a_proj_with_mqa.weight",), ((c + r, d),),
                lambda w: reorder(w.T, halves), lambda x: (reorder(x, pairs).T,)),
           _same(blk + ("kv_norm", "scale"), attn + "kv_a_layernorm.weight", (c,)),
           Rule(blk + ("wkv_up",), (attn + "kv_b_proj.weight",), ((h * (n + v), c),),
                lambda w: w.T.reshape(c, h, n + v), lambda x: (x.reshape(c, -1).T,)),
           Rule(blk + ("wo",), (attn + "o_proj.weight",), ((d, h * v),),
                lambda w: w.T.reshape(h, v, d), lambda x: (x.reshape(h * v, d).T,))]
    if cfg.q_lora_rank is None:
        return [heads("wq", "q_proj.weight", d), *out]
    return [_transposed(blk + ("wq_down",), attn + "q_a_proj.weight", (cfg.q_lora_rank, d)),
            _same(blk + ("q_norm", "scale"), attn + "q_a_layernorm.weight", (cfg.q_lora_rank,)),
            heads("wq_up", "q_b_proj.weight", cfg.q_lora_rank), *out]


def _deepseek_moe_rules(cfg: ModelConfig, moe: str, mlp: tuple[str, ...]) -> list[Rule]:
    """DeepSeek-V3's mlp (`moe`: its HF prefix, `mlp`: its megajax path): the router (gate), its
    e_score_correction_bias (megajax's auxiliary-loss-free balancing bias, when the model has one), the experts and
    the ungated shared experts."""
    from megajax.model.moe import ROUTER_BIAS

    e = cfg.num_experts
    bias = ([_same(mlp + (ROUTER_BIAS,), moe + "gate.e_score_correction_bias", (e,))]
            if cfg.moe_router_bias_update_rate else [])
    return [*_expert_rules(cfg, moe, ("gate_proj", "up_proj", "down_proj"), mlp), *bias,
            *_swiglu_rules(mlp + ("shared",), moe + "shared_experts.", cfg.hidden_size,
                           cfg.moe_shared_experts * cfg.moe_ffn_size)]


def rules(cfg: ModelConfig, rope_interleave: bool = True) -> list[Rule]:
    """The conversion table of `cfg`'s architecture. rope_interleave: a DeepSeek-V3 source lays out its RoPE
    dimensions in pairs (config.json's rope_interleave, the default); exports always do."""
    require_convertible(cfg)
    return _gpt2_rules(cfg) if cfg.arch == "gpt2" else _llama_rules(cfg, rope_interleave)


def _config_summary(cfg: ModelConfig) -> str:
    return (f"num_layers={cfg.num_layers} hidden_size={cfg.hidden_size} num_heads={cfg.num_heads} "
            f"num_kv_heads={cfg.kv_heads} ffn={cfg.ffn_size} vocab_size={cfg.vocab_size} "
            f"seq_length={cfg.seq_length} tied={cfg.tied}")


def params_from_hf(cfg: ModelConfig, get: Callable[[str], np.ndarray | None], names: Iterable[str],
                   source: str = "the model", rope_interleave: bool = True) -> dict:
    """The megajax parameter tree (NumPy, layers stacked, cfg.param_dtype) from HF tensors.

    get(name) returns a tensor or None if missing; names lists every tensor the source holds, so that
    tensors the config does not account for (more layers, biases) are errors rather than dropped.
    """
    dtype = _np_dtype(cfg.param_dtype)
    used: set[str] = set()

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
        w = get(name)
        if w is None:
            raise ConversionError(f"missing tensor {name!r} in {source} (a {cfg.arch} model with "
                                  f"{_config_summary(cfg)})")
        if tuple(w.shape) != shape:
            raise ConversionError(f"tensor {name!r} in {source} has shape {tuple(w.shape)}, but config.json "
                                  f"({_config_summary(cfg)}) needs {shape}")
        used.add(name)
        return w.astype(dtype)

    params: dict = {}
    for rule in rules(cfg, rope_interleave):
        def one(i: int | None, rule=rule) -> np.ndarray:
            ws = [fetch(n.format(i=i), s) for n, s in zip(rule.names, rule.shapes)]
            return np.ascontiguousarray(rule.to_megajax(*ws))

        value = (np.stack([one(i) for i in range(cfg.first_dense_layers, cfg.num_layers)]) if rule.per_layer
                 else one(None))
        node = params
        for key in rule.path[:-1]:
            node = node.setdefault(key, {})
        node[rule.path[-1]] = value
    _zero_channels(cfg, params, dtype)
    ignorable, copies = _BUFFERS[cfg.arch], _mtp_copies(cfg)
    for name in sorted(set(names) - used):
        if ignorable.search(name) or (cfg.tied and name == "lm_head.weight"):
            continue  # a buffer, or the tied output layer saved twice
        if name in copies:  # a multi-token prediction module's copy of the embedding or output layer
            _require_copy(get, name, copies[name], source)
            continue
        raise ConversionError(f"unexpected tensor {name!r} in {source}: not part of a {cfg.arch} model with "
                              f"{_config_summary(cfg)} (does config.json describe these weights?)")
    return params


def _zero_channels(cfg: ModelConfig, params: dict, dtype) -> None:
    """The statistics channels' zero parameters, which have no HF tensor: each MoE layer's
    (megajax.model.moe.STATS) and each multi-token prediction module's (model_state.MTP_STATS)."""
    from megajax.model.model_state import MTP_STATS
    from megajax.model.moe import STATS

    width = cfg.num_experts + 3
    if cfg.num_experts:
        params["layers"]["block"]["mlp"][STATS] = np.zeros((cfg.stacked_layers, width), dtype)
    for k in range(1, cfg.mtp_num_layers + 1):
        params[f"mtp_{k}"][MTP_STATS] = np.zeros((2,), dtype)
        if cfg.num_experts:
            params[f"mtp_{k}"]["block"]["mlp"][STATS] = np.zeros((width,), dtype)


def _require_copy(get, name: str, original: str, source: str) -> None:
    """A multi-token prediction module's copy `name` of the shared tensor `original` must equal it: megajax's
    modules share the embedding and output layer."""
    copy, shared = get(name), get(original)
    if shared is None or copy.shape != shared.shape or not np.array_equal(copy, shared):
        raise ConversionError(f"tensor {name!r} in {source} differs from {original!r}: megajax's multi-token "
                              "prediction modules share the model's embedding and output layer, so a module "
                              "trained with its own does not convert")


def _leaf(params: dict, path: tuple[str, ...], where: str) -> np.ndarray:
    node: Any = params
    for key in path:
        if not isinstance(node, dict) or key not in node:
            raise ConversionError(f"parameter {'/'.join(path)} is missing from {where}")
        node = node[key]
    return np.asarray(node)


def params_to_hf(cfg: ModelConfig, params: dict, dtype: str | None = None,
                 where: str = "the checkpoint") -> dict[str, np.ndarray]:
    """HF tensor name -> array for a megajax parameter tree (NumPy or jax arrays, canonical layout).

    dtype: the output dtype (float32, bfloat16, float16); None keeps each parameter's own.
    """
    out: dict[str, np.ndarray] = {}
    for rule in rules(cfg):
        value = _leaf(params, rule.path, where)
        first = cfg.first_dense_layers  # the stack's layer j is HF's first + j
        layers = range(first, cfg.num_layers) if rule.per_layer else [None]
        for i in layers:
            ws = rule.to_hf(value[i - first] if i is not None else value)
            for name, shape, w in zip(rule.names, rule.shapes, ws):
                name = name.format(i=i)
                if tuple(w.shape) != shape:
                    raise ConversionError(f"parameter {'/'.join(rule.path)} in {where} gives {name!r} the shape "
                                          f"{tuple(w.shape)}, but its config ({_config_summary(cfg)}) needs {shape}")
                w = np.ascontiguousarray(w)
                out[name] = w.astype(_np_dtype(dtype)) if dtype else w
    for name, original in _mtp_copies(cfg).items():  # (DeepSeek-V3's folders carry them: vLLM reads them)
        out[name] = out[original]
    return out


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
