"""Hugging Face config.json <-> megajax ModelConfig, one mapping per architecture, and the checks that say
which Hugging Face architecture a megajax model converts as (or why it has none).

Supported: GPT2LMHeadModel, LlamaForCausalLM (grouped-query attention, tied or untied embeddings),
MixtralForCausalLM (a Llama with a mixture-of-experts MLP: megajax's llama arch with model.num_experts),
Qwen2ForCausalLM (a Llama with QKV biases: model.add_qkv_bias) and Qwen2MoeForCausalLM (QKV biases, experts
weighted by their probabilities without renormalising: model.moe_router_pre_softmax, and a shared expert behind
a sigmoid gate: model.moe_shared_experts with model.moe_shared_expert_gate), and DeepseekV3ForCausalLM
(model.multi_latent_attention, sigmoid group-limited routing with its correction bias as the router bias, dense
first layers: model.moe_first_dense_layers, YaRN RoPE).

The tensors' names and layouts are megajax/hf/weights.py's; the folders on disk, megajax/hf/folders.py's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megajax.config import ConfigError, ModelConfig
from megajax.hf.errors import ConversionError, read_json

# HF model_type -> architecture (megajax arch: gpt2, or llama for the others)
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}


def read_hf_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ConversionError(f"{model_dir} has no config.json: is it a Hugging Face model folder?")
    return read_json(path)


def hf_arch(hf: dict) -> str:
    """A key of ARCHITECTURES from config.json's model_type and architectures; anything else is an error."""
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    if model_type not in ARCHITECTURES:
        raise ConversionError(f"unknown architecture: model_type={model_type!r} (architectures={archs}); "
                              f"megajax converts {', '.join(ARCHITECTURES.values())}")
    want = ARCHITECTURES[model_type]
    if archs and want not in archs:
        raise ConversionError(f"unknown architecture {archs}: megajax converts {want} for model_type="
                              f"{model_type!r} (a causal language model with its output layer)")
    return model_type


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConversionError(message)


def model_config_from_hf(hf: dict) -> ModelConfig:
    """The megajax model config equivalent to an HF config.json (fp32 parameters, Megatron vocab padding)."""
    arch = hf_arch(hf)
    try:
        return {"gpt2": _gpt2_config, "llama": _llama_config, "mixtral": _mixtral_config, "qwen2": _qwen2_config,
                "qwen2_moe": _qwen2_moe_config, "deepseek_v3": _deepseek_v3_config}[arch](hf)
    except KeyError as e:
        raise ConversionError(f"config.json of a {arch} model has no {e.args[0]!r}") from None
    except ConfigError as e:
        raise ConversionError(f"config.json does not make a valid megajax model: {e}") from None


def _gpt2_config(hf: dict) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    _require(act in ("gelu_new", "gelu_pytorch_tanh"),
             f"GPT-2 activation_function={act!r} is not supported: megajax uses the tanh GeLU (gelu_new)")
    _require(hf.get("scale_attn_weights", True), "GPT-2 scale_attn_weights=false is not supported")
    _require(not hf.get("scale_attn_by_inverse_layer_idx", False),
             "GPT-2 scale_attn_by_inverse_layer_idx=true is not supported")
    _require(not hf.get("add_cross_attention", False), "GPT-2 add_cross_attention=true is not supported")
    return ModelConfig(
        arch="gpt2", num_layers=hf["n_layer"], hidden_size=hf["n_embd"], num_heads=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner") or 4 * hf["n_embd"], vocab_size=hf["vocab_size"],
        seq_length=hf.get("n_positions", hf.get("n_ctx", 1024)), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        dropout=hf.get("resid_pdrop", 0.0), attention_dropout=hf.get("attn_pdrop", 0.0),
        tie_embeddings=hf.get("tie_word_embeddings", True), init_std=hf.get("initializer_range", 0.02))


def _llama_config(hf: dict) -> ModelConfig:
    _require(hf.get("hidden_act", "silu") == "silu",
             f"Llama hidden_act={hf.get('hidden_act')!r} is not supported: megajax's SwiGLU uses silu")
    _require(not hf.get("attention_bias", False), "Llama attention_bias=true is not supported (megajax's Llama "
                                                  "attention has no biases)")
    _require(not hf.get("mlp_bias", False), "Llama mlp_bias=true is not supported")
    rope, scaling = _rope_config(hf, "Llama")
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // h
    _require(head_dim * h == d, f"Llama head_dim={head_dim} with num_attention_heads={h} does not give "
                                f"hidden_size={d}: megajax needs head_dim = hidden_size / heads")
    return ModelConfig(
        arch="llama", num_layers=hf["num_hidden_layers"], hidden_size=d, num_heads=h,
        num_kv_heads=hf.get("num_key_value_heads") or h, ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], seq_length=hf.get("max_position_embeddings", 2048),
        norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 1e4))),
        attention_dropout=hf.get("attention_dropout", 0.0),
        tie_embeddings=hf.get("tie_word_embeddings", False), init_std=hf.get("initializer_range", 0.02), **scaling)


def _rope_config(hf: dict, family: str) -> tuple[dict, dict]:
    """(config.json's RoPE parameters, the megajax model fields of their scaling): none, Llama 3.1's or YaRN's."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    _require(rope_type in ("default", "llama3", "yarn"), f"{family} rope type {rope_type!r} is not supported: only "
             "plain RoPE (rope_type 'default'), Llama 3.1's 'llama3' scaling and 'yarn'")
    if rope_type == "llama3":
        return rope, dict(rope_scaling="llama3", rope_scaling_factor=float(rope["factor"]),
                          rope_low_freq_factor=float(rope["low_freq_factor"]),
                          rope_high_freq_factor=float(rope["high_freq_factor"]),
                          rope_original_max_positions=int(rope["original_max_position_embeddings"]))
    if rope_type == "yarn":
        _require(rope.get("attention_factor") is None and rope.get("truncate", True) and rope.get("factor"),
                 "YaRN RoPE with an explicit attention_factor, truncate=false or no factor is not supported")
        return rope, dict(rope_scaling="yarn", rope_scaling_factor=float(rope["factor"]),
                          rope_original_max_positions=int(rope["original_max_position_embeddings"]),
                          rope_yarn_beta_fast=float(rope.get("beta_fast") or 32),
                          rope_yarn_beta_slow=float(rope.get("beta_slow") or 1),
                          rope_yarn_mscale=float(rope.get("mscale") or 0),
                          rope_yarn_mscale_all_dim=float(rope.get("mscale_all_dim") or 0))
    return rope, {}


def _rope_parameters(cfg: ModelConfig) -> dict:
    """config.json's rope_parameters for `cfg` (the inverse of `_rope_config`)."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=cfg.rope_scaling_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_positions)
    if cfg.rope_scaling == "yarn":
        rope.update(rope_type="yarn", factor=cfg.rope_scaling_factor, beta_fast=cfg.rope_yarn_beta_fast,
                    beta_slow=cfg.rope_yarn_beta_slow, mscale=cfg.rope_yarn_mscale,
                    mscale_all_dim=cfg.rope_yarn_mscale_all_dim,
                    original_max_position_embeddings=cfg.rope_original_max_positions)
    return rope


def _mixtral_config(hf: dict) -> ModelConfig:
    window = hf.get("sliding_window")
    seq = hf.get("max_position_embeddings", 2048)
    _require(window is None or window >= seq, f"Mixtral sliding_window={window} is shorter than "
             f"max_position_embeddings={seq}: megajax has no sliding-window attention (set it to null)")
    _require(not hf.get("router_jitter_noise", 0.0), "Mixtral router_jitter_noise is not supported: set it to 0")
    f = hf["intermediate_size"]
    return dataclasses.replace(
        _llama_config(hf), num_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=f, moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)))


def _qwen_sliding_window(hf: dict) -> None:
    _require(not hf.get("use_sliding_window", False), "Qwen use_sliding_window=true is not supported: megajax has no "
             "sliding-window attention (set it to false)")


def _qwen2_config(hf: dict) -> ModelConfig:
    _qwen_sliding_window(hf)
    return dataclasses.replace(_llama_config(hf), add_qkv_bias=True)


def _qwen2_moe_config(hf: dict) -> ModelConfig:
    _qwen_sliding_window(hf)
    _require(hf.get("decoder_sparse_step", 1) == 1 and not hf.get("mlp_only_layers"),
             f"Qwen2-MoE decoder_sparse_step={hf.get('decoder_sparse_step')} / mlp_only_layers="
             f"{hf.get('mlp_only_layers')}: megajax converts Qwen2-MoE with experts in every layer (1 and []); its "
             "model.moe_layer_freq n puts the MoE layers at 0, n, 2n, .., not Qwen's n - 1, 2n - 1, ..")
    f, shared = hf["moe_intermediate_size"], hf["shared_expert_intermediate_size"]
    _require(shared > 0 and shared % f == 0, f"Qwen2-MoE shared_expert_intermediate_size={shared} is not a "
             f"positive multiple of moe_intermediate_size={f}: megajax's shared experts are model.moe_shared_experts "
             "times the expert width")
    return dataclasses.replace(
        _llama_config(hf), add_qkv_bias=bool(hf.get("qkv_bias", True)), num_experts=hf["num_experts"],
        experts_per_token=hf["num_experts_per_tok"], moe_ffn_hidden_size=f, moe_shared_experts=shared // f,
        moe_shared_expert_gate=True, moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
        moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))


DEEPSEEK_BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed (gamma) for most of its training


def _deepseek_v3_config(hf: dict) -> ModelConfig:
    """DeepSeek-V3: multi-latent attention, sigmoid routing with a correction bias (imported as the
    auxiliary-loss-free balancing bias, updated at DEEPSEEK_BIAS_RATE when trained on), group-limited top k, the
    weights scaled by routed_scaling_factor, shared experts, the first first_k_dense_replace layers dense
    (model.moe_first_dense_layers; all of them: a dense model with multi-latent attention), and
    num_nextn_predict_layers multi-token prediction modules (model.mtp_num_layers)."""
    layers, dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 0)
    _require(hf.get("rms_norm_eps", 1e-6) == 1e-6, "DeepSeek-V3 rms_norm_eps must be 1e-6 here: Hugging Face's "
             "latent norms always use 1e-6 and megajax uses one epsilon for every norm")
    _require(hf.get("hidden_act", "silu") == "silu", "DeepSeek-V3 hidden_act must be silu (megajax's SwiGLU)")
    _require(not hf.get("attention_bias", False), "DeepSeek-V3 attention_bias=true is not supported")
    rope, scaling = _rope_config(hf, "DeepSeek-V3")
    _require(hf.get("norm_topk_prob", True), "DeepSeek-V3 norm_topk_prob=false is not supported: megajax "
             "normalises the k sigmoid scores (as Megatron)")
    groups, best, k = hf.get("n_group") or 1, hf.get("topk_group") or 1, hf["num_experts_per_tok"]
    _require(groups == 1 or k == 2 * best, f"DeepSeek-V3 scores a group by its top two experts: megajax scores it by "
             f"its top num_experts_per_tok / topk_group, so topk_group must be num_experts_per_tok / 2, got {best} "
             f"for {k}")
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    cfg = ModelConfig(
        arch="llama", num_layers=layers, hidden_size=d, num_heads=h, ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], seq_length=hf.get("max_position_embeddings", 2048), norm_eps=1e-6,
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 1e4))),
        attention_dropout=hf.get("attention_dropout", 0.0), tie_embeddings=hf.get("tie_word_embeddings", False),
        init_std=hf.get("initializer_range", 0.02), multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        mtp_num_layers=hf.get("num_nextn_predict_layers") or 0, **scaling)
    if dense >= layers:
        return cfg
    return dataclasses.replace(
        cfg, moe_first_dense_layers=dense, num_experts=hf["n_routed_experts"], experts_per_token=k,
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_shared_experts=hf.get("n_shared_experts") or 0, moe_router_score_function="sigmoid",
        moe_router_num_groups=groups if groups > 1 else None, moe_router_group_topk=best if groups > 1 else None,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        moe_router_bias_update_rate=DEEPSEEK_BIAS_RATE, moe_aux_loss_coef=float(hf.get("aux_loss_alpha", 1e-4)))


def _deepseek(cfg: ModelConfig) -> bool:
    """Whether `cfg` converts as DeepSeek-V3: multi-latent attention or sigmoid routing."""
    return cfg.multi_latent_attention or (cfg.num_experts > 0 and cfg.moe_router_score_function == "sigmoid")


def _require_deepseek(cfg: ModelConfig) -> None:
    _require(cfg.multi_latent_attention, "sigmoid routing converts as DeepSeek-V3, which has multi-latent attention: "
             "set model.multi_latent_attention=true, or route with softmax (Mixtral, Qwen2-MoE)")
    _require(cfg.norm_eps == 1e-6, f"model.norm_eps={cfg.norm_eps}: DeepSeek-V3's latent norms use 1e-6, so a model "
             "with another epsilon does not convert")
    if not cfg.num_experts:
        return
    _require(cfg.moe_router_score_function == "sigmoid" and cfg.moe_layer_freq == 1 and cfg.moe_shared_experts > 0
             and not cfg.moe_shared_expert_gate,
             "DeepSeek-V3 routes with sigmoid scores in every layer and has ungated shared experts: set "
             "model.moe_router_score_function=sigmoid, model.moe_layer_freq=1, model.moe_shared_experts >= 1 and "
             "model.moe_shared_expert_gate=false")
    groups = cfg.moe_router_num_groups or 1
    _require(groups == 1 or cfg.experts_per_token == 2 * cfg.moe_router_group_topk,
             "DeepSeek-V3 scores an expert group by its top two experts: model.moe_router_group_topk must be "
             "model.experts_per_token / 2 for the model to convert")


def require_convertible(cfg: ModelConfig) -> None:
    """An MoE model converts as Mixtral (llama, no shared experts, renormalised routing, no QKV biases) or as
    Qwen2-MoE (llama, gated shared experts)."""
    if _deepseek(cfg):
        _require_deepseek(cfg)
        return
    _require(not cfg.mtp_num_layers, f"model.mtp_num_layers={cfg.mtp_num_layers}: multi-token prediction converts as "
             "DeepSeek-V3's (its layers after the model's in Hugging Face's folder), which has multi-latent attention: "
             "set model.multi_latent_attention=true, or model.mtp_num_layers=0")
    if not cfg.num_experts:
        return
    _require(cfg.arch == "llama", f"model.num_experts={cfg.num_experts} with model.arch=gpt2 has no Hugging Face "
             "counterpart: MoE models convert as Mixtral or Qwen2-MoE (model.arch=llama)")
    _require(not cfg.moe_router_bias_update_rate, "model.moe_router_bias_update_rate: Mixtral and Qwen2-MoE route "
             "without a bias, so a model trained with one does not convert")
    _require(cfg.moe_layer_freq == 1, f"model.moe_layer_freq={cfg.moe_layer_freq}: Mixtral and Qwen2-MoE (as "
             "converted here) have experts in every layer, so a model with dense layers between its MoE layers does "
             "not convert")
    if cfg.moe_shared_experts:
        _require(cfg.moe_shared_expert_gate, f"model.moe_shared_experts={cfg.moe_shared_experts} without "
                 "model.moe_shared_expert_gate: Hugging Face's MoE with shared experts (Qwen2-MoE) gates them, so "
                 "this model does not convert")
    else:
        _require(not cfg.moe_router_pre_softmax and not cfg.add_qkv_bias, "model.moe_router_pre_softmax or "
                 "model.add_qkv_bias without shared experts: Mixtral renormalises the top k and has no QKV biases, "
                 "and Qwen2-MoE has a shared expert, so this model does not convert")


def _hf_model_type(cfg: ModelConfig) -> str:
    require_convertible(cfg)
    if cfg.arch == "gpt2":
        return "gpt2"
    if _deepseek(cfg):
        return "deepseek_v3"
    if cfg.num_experts:
        return "qwen2_moe" if cfg.moe_shared_experts else "mixtral"
    return "qwen2" if cfg.add_qkv_bias else "llama"


def hf_config_from_model(cfg: ModelConfig, dtype: str = "float32", base: dict | None = None,
                         eos_token_id: int | None = None) -> dict:
    """config.json for `cfg`. `base` (the config.json a model was imported from) keeps its other fields,
    such as token ids; without it, bos and eos are `eos_token_id`."""
    model_type = _hf_model_type(cfg)
    # (an FP8 source's quantization_config: the weights written are dequantized, in `dtype`)
    out = {k: v for k, v in (base or {}).items() if k not in ("transformers_version", "quantization_config")}
    if base is None:
        out.update(bos_token_id=eos_token_id, eos_token_id=eos_token_id)
    out.update(architectures=[ARCHITECTURES[model_type]], model_type=model_type, vocab_size=cfg.vocab_size,
               tie_word_embeddings=cfg.tied, initializer_range=cfg.init_std, use_cache=True,
               torch_dtype=dtype, dtype=dtype)  # transformers 4 reads torch_dtype, 5 prefers dtype
    if cfg.arch == "gpt2":
        if cfg.kv_heads != cfg.num_heads:
            raise ConversionError(f"GPT2LMHeadModel has no grouped-query attention: model.num_kv_heads="
                                  f"{cfg.kv_heads} != model.num_heads={cfg.num_heads} cannot be exported")
        out.update(n_layer=cfg.num_layers, n_embd=cfg.hidden_size, n_head=cfg.num_heads, n_inner=cfg.ffn_size,
                   n_positions=cfg.seq_length, n_ctx=cfg.seq_length, layer_norm_epsilon=cfg.norm_eps,
                   activation_function="gelu_new", resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                   attn_pdrop=cfg.attention_dropout, scale_attn_weights=True)
    else:
        rope = _rope_parameters(cfg)
        out.update(num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                   num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                   intermediate_size=cfg.ffn_size, max_position_embeddings=cfg.seq_length,
                   rms_norm_eps=cfg.norm_eps, hidden_act="silu", attention_dropout=cfg.attention_dropout,
                   rope_theta=cfg.rope_theta, rope_parameters=rope)
        out.pop("rope_scaling", None)
        if model_type == "deepseek_v3":
            out.update(_deepseek_v3_fields(cfg))
        elif model_type in ("llama", "mixtral"):
            out.update(attention_bias=False, mlp_bias=False)
        else:
            out.update(use_sliding_window=False, sliding_window=None)
        if model_type == "mixtral":
            out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                       intermediate_size=cfg.moe_ffn_size, router_aux_loss_coef=cfg.moe_aux_loss_coef,
                       output_router_logits=False, router_jitter_noise=0.0, sliding_window=None)
        if model_type == "qwen2_moe":
            out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                       moe_intermediate_size=cfg.moe_ffn_size,
                       shared_expert_intermediate_size=cfg.moe_shared_experts * cfg.moe_ffn_size,
                       norm_topk_prob=not cfg.moe_router_pre_softmax, qkv_bias=cfg.add_qkv_bias,
                       decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=cfg.moe_aux_loss_coef,
                       output_router_logits=False)
    return out


def _deepseek_v3_fields(cfg: ModelConfig) -> dict:
    """config.json fields of a DeepSeek-V3 model (exported with interleaved RoPE weights, as DeepSeek's own)."""
    out = dict(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_head_dim,
               qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
               qk_head_dim=cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, head_dim=cfg.qk_pos_emb_head_dim,
               rope_interleave=True, attention_bias=False, num_nextn_predict_layers=cfg.mtp_num_layers,
               first_k_dense_replace=cfg.first_dense_layers if cfg.num_experts else cfg.num_layers)
    if cfg.num_experts:
        out.update(n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                   moe_intermediate_size=cfg.moe_ffn_size, n_shared_experts=cfg.moe_shared_experts,
                   n_group=cfg.moe_router_num_groups or 1, topk_group=cfg.moe_router_group_topk or 1,
                   routed_scaling_factor=cfg.moe_router_topk_scaling_factor or 1.0, norm_topk_prob=True,
                   aux_loss_alpha=cfg.moe_aux_loss_coef)
    return out
