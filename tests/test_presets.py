"""The GPU presets run as they are: configs/llama3-8b.yaml on one node of 8 H100s and configs/llama3-70b.yaml on 8
nodes (64 H100s). Each has Meta's Llama 3 shapes, a layout that uses exactly its GPUs (tensor parallel inside a
node), bf16 compute on fp32 master weights with the fused Pallas kernels, sequence parallelism with the rings of
parallel.tp_comm_overlap, the distributed optimizer with its overlapped reduction and gather, and a placeholder
tokenizer the user must replace. XLA's GPU compiler compiles each train step for compile-only H100s (the 70B's with
-m slow): its memory estimate fits an 80 GB H100 with margin, and the tensor-parallel rings run under the GEMMs."""

import os

import pytest

from megajax import audit, config as config_lib
from megajax.config import io as config_io
from megajax.config import ConfigError
from megajax.kernels import auto as kernel_choice

from conftest import REPO, gpu

# name: (GPUs, Meta's config.json shapes, the layout as (data, pipeline, tensor, virtual stages), peak lr)
PRESETS = {
    "llama3-8b": (8, {"num_layers": 32, "hidden_size": 4096, "num_heads": 32, "num_kv_heads": 8,
                      "ffn_hidden_size": 14336}, (2, 1, 4, 1), 3e-4),
    "llama3-70b": (64, {"num_layers": 80, "hidden_size": 8192, "num_heads": 64, "num_kv_heads": 8,
                        "ffn_hidden_size": 28672}, (2, 4, 8, 5), 1.5e-4),
}
# XLA's estimate leaves out NCCL's and cuBLAS's workspaces: a preset keeps this much of an 80 GB H100's 79.1 GiB
MAX_GIB = 72.0


def _load(name: str) -> config_lib.Config:
    return config_io.load(os.path.join(REPO, "configs", f"{name}.yaml"))


@pytest.mark.parametrize("name", PRESETS)
def test_preset_is_llama3_at_8192_tokens(name):
    m = _load(name).model
    for key, value in PRESETS[name][1].items():
        assert getattr(m, key) == value, key
    assert m.arch == "llama" and m.vocab_size == m.padded_vocab_size == 128256 and not m.tied
    assert m.rope_theta == 500000.0 and m.rope_scaling == "none" and m.norm_eps == 1e-5
    assert m.seq_length == 8192


@pytest.mark.parametrize("name", PRESETS)
def test_preset_layout_uses_exactly_its_gpus(name):
    gpus, _, (data, pipe, tensor, virtual), _ = PRESETS[name]
    cfg = _load(name)
    p = cfg.parallel
    assert (p.data, p.pipeline, p.tensor, p.virtual_stages, p.context, p.expert) == (data, pipe, tensor, virtual, 1, 1)
    resolved = cfg.for_devices(gpus)
    assert resolved.parallel.data * p.pipeline * p.tensor == gpus
    for other in (gpus // 2, 2 * gpus):
        with pytest.raises(ConfigError, match="devices"):
            cfg.for_devices(other)
    # tensor parallelism inside a node, everything else across nodes; micro batch 1
    assert p.tensor <= audit.GPUS_PER_HOST
    assert resolved.train.micro_batch_size == 1
    assert resolved.num_micro_batches * data == cfg.train.global_batch_size
    if p.virtual_stages > 1:
        assert p.schedule == "interleaved" and resolved.num_micro_batches >= p.pipeline


@pytest.mark.parametrize("name", PRESETS)
def test_preset_trains_in_bf16_with_fused_kernels_and_overlap(name):
    cfg = _load(name)
    m, p, o = cfg.model, cfg.parallel, cfg.optim
    assert m.compute_dtype == "bfloat16" and m.param_dtype == "float32" and m.fp8 == "none"
    # the fused kernels on GPUs, chosen there (auto); cuDNN's attention is an override (model.attention_impl=cudnn)
    assert m.attention_impl == "auto" and m.norm_impl == "auto"
    assert kernel_choice.summary(m.attention_impl, m.norm_impl, head_dim=m.head_dim, width=m.hidden_size,
                                 platform="gpu").startswith(
        "attention pallas (auto on gpu), norms pallas")
    assert m.recompute == "selective"
    assert p.sequence_parallel and p.tp_comm_overlap
    assert p.sharding_strategy == "optim" and p.overlap_grad_reduce and p.overlap_param_gather
    # across nodes with a pipeline the idle ticks' reductions are capped by the audit's comm_ratio
    assert (p.overlap_comm_ratio > 0) == (p.pipeline > 1)
    # Meta's schedule: cosine from the peak to a tenth of it after 2000 warm-up steps
    assert o.lr == PRESETS[name][3] and o.min_lr == pytest.approx(o.lr / 10)
    assert o.decay == "cosine" and o.warmup_steps == 2000 and o.decay_steps is None
    # the data and Meta's tokenizer are the user's to give: a placeholder folder that does not exist
    assert cfg.data.paths == [] and cfg.data.tokenizer.startswith("/path/to/Meta-Llama-3-")
    assert not os.path.exists(cfg.data.tokenizer)
    assert cfg.train.output_dir == f"runs/{name}" and cfg.checkpoint.every > 0


@gpu
# suite time: compiling the whole train step for compile-only H100s takes 30 s for the 8B, 170 s for the 70B (80 layers
# on an interleaved pipeline; 2 cores): both with -m slow; the default run checks each preset's layout and settings
@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b"])
def test_preset_fits_an_h100_with_the_rings_under_the_gemms(name):
    gpus, _, (data, pipe, tensor, virtual), _ = PRESETS[name]
    cfg = _load(name)
    report = audit.audit(cfg, "h100", gpus)
    layout = report["layout"]
    assert report["devices"] == gpus
    assert (layout["data"], layout["pipeline"], layout["tensor"], layout["virtual_stages"]) == (data, pipe, tensor,
                                                                                               virtual)
    memory = report["memory_per_device"]
    assert memory["fits"] and memory["peak_estimate_gib"] <= MAX_GIB, memory
    comm = report["communication"]
    # over its memory budget XLA's scheduler stops overlapping: the rings' ppermutes (or, in a pipeline, their chunked
    # all-gathers) then run with no GEMM under them
    rings = comm["groups"]["collective-permute over tensor" if pipe == 1 else "all-gather over tensor"]
    assert rings["overlapped_fraction"] > 0.95, rings
    assert comm["exposed_comm_s"] < 0.25 * comm["gemm_s_at_peak"], comm
    if pipe > 1:  # the preset's cap is the audit's ratio (one layer's reduce-scatter over its forward)
        assert cfg.parallel.overlap_comm_ratio == pytest.approx(comm["in_schedule"]["comm_ratio"], rel=0.05)


# The largest open models on 1024 GPUs: (GPUs, released shapes, layout as (data, pipeline, tensor, virtual stages,
# expert), each stage's transformer layers): Llama 3.1 405B split unevenly over 16 pipeline stages, DeepSeek-V3 with
# no pipeline (ZeRO-3, the experts over expert 128 x tensor 2: the layout the planner prefers once compiled)
LARGE = {
    "llama3.1-405b": (1024, {"num_layers": 126, "hidden_size": 16384, "num_heads": 128, "num_kv_heads": 8,
                             "ffn_hidden_size": 53248, "vocab_size": 128256, "seq_length": 8192},
                      (8, 16, 8, 4, 1), [7] + [8] * 14 + [7]),
    "deepseek-v3": (1024, {"num_layers": 61, "hidden_size": 7168, "num_heads": 128, "ffn_hidden_size": 18432,
                           "vocab_size": 129280, "seq_length": 4096, "multi_latent_attention": True,
                           "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64,
                           "v_head_dim": 128, "num_experts": 256, "experts_per_token": 8, "moe_ffn_hidden_size": 2048,
                           "moe_shared_experts": 1, "moe_first_dense_layers": 3,
                           "moe_router_score_function": "sigmoid", "moe_router_num_groups": 8,
                           "moe_router_group_topk": 4, "moe_router_topk_scaling_factor": 2.5},
                    (512, 1, 2, 1, 128), [61]),
}


@pytest.mark.parametrize("name", LARGE)
def test_large_preset_has_the_released_shapes_and_its_layout(name):
    gpus, shapes, (data, pipe, tensor, virtual, expert), stages = LARGE[name]
    cfg = _load(name)
    for key, value in shapes.items():
        assert getattr(cfg.model, key) == value, key
    p = cfg.parallel
    assert (p.data, p.pipeline, p.tensor, p.virtual_stages, p.expert) == (data, pipe, tensor, virtual, expert)
    resolved = cfg.for_devices(gpus)
    assert resolved.parallel.data * p.pipeline * p.tensor == gpus and p.tensor <= audit.GPUS_PER_HOST
    split = resolved.stage_split
    assert [sum(split.layers[r::pipe]) for r in range(pipe)] == stages and split.even == (pipe == 1)
    assert cfg.model.compute_dtype == "bfloat16" and cfg.model.param_dtype == "float32"
    assert cfg.data.paths == [] and not os.path.exists(cfg.data.tokenizer)
    if name == "deepseek-v3":  # the auxiliary-loss-free balancing; ZeRO-3 with the experts one a GPU
        assert cfg.model.moe_router_bias_update_rate == 0.001 and p.expert * p.tensor == cfg.model.num_experts
        assert p.shards_params and p.folded_experts


@gpu
# suite time: about 100 s (405B) and 150 s (DeepSeek-V3) to compile each for 1024 compile-only H100s on 2 cores
@pytest.mark.slow
@pytest.mark.parametrize("name", LARGE)
def test_large_preset_fits_an_h100(name):
    gpus, _, (data, pipe, tensor, virtual, expert), _ = LARGE[name]
    report = audit.audit(_load(name), "h100", gpus)
    layout = report["layout"]
    assert (layout["data"], layout["pipeline"], layout["tensor"], layout["virtual_stages"], layout["expert"]) == (
        data, pipe, tensor, virtual, expert)
    memory = report["memory_per_device"]
    assert memory["fits"] and memory["peak_estimate_gib"] <= MAX_GIB, memory
