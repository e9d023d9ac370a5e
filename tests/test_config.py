import glob
import os
import itertools

import pytest

from megajax import config as config_lib
from megajax.config import io as config_io
from megajax.config import ConfigError

from conftest import REPO, small_config


def load(*sets, path=None):
    return config_io.load(path, list(sets))


def test_defaults_and_overrides_are_typed():
    cfg = load("model.num_layers=4", "parallel.sequence_parallel=true", "parallel.tensor=2",
               "data.paths=[0.3,a,0.7,b]", "optim.lr=1e-3", "checkpoint.async=false")
    assert cfg.model.num_layers == 4 and cfg.parallel.sequence_parallel is True
    assert cfg.data.paths == [0.3, "a", 0.7, "b"]
    assert cfg.optim.lr == 1e-3 and cfg.checkpoint.async_ is False
    assert cfg.to_dict()["checkpoint"]["async"] is False


@pytest.mark.parametrize("sets, needle", [
    (["model.num_layer=4"], "unknown config key 'model.num_layer'"),
    (["nosuch.key=1"], "unknown config section 'nosuch' (sections: checkpoint, data, model, optim, parallel, train)"),
    (["model.num_layers=four"], "model.num_layers must be an integer"),
    (["parallel.sequence_parallel=maybe"], "must be true or false"),
    (["model.arch=bert"], "model.arch='bert' is not one of gpt2, llama"),
    (["parallel.tensor=3"], "model.num_heads=4 is not divisible by parallel.tensor=3"),
    (["model.num_heads=8", "model.num_kv_heads=2", "parallel.tensor=4"], "model.num_kv_heads=2 is not divisible"),
    (["model.num_layers=3", "parallel.pipeline=2"], "model.num_layers=3 is not divisible by parallel.pipeline"),
    (["model.num_layers=2", "parallel.pipeline=2", "parallel.virtual_stages=2", "parallel.schedule=interleaved"],
     "more than model.num_layers=2"),
    (["parallel.data=2", "train.global_batch_size=6", "train.micro_batch_size=2"],
     "not divisible by data parallel size 2 x train.micro_batch_size=2"),
    (["parallel.virtual_stages=2"], "needs parallel.schedule=interleaved"),
    (["parallel.data=1", "parallel.pipeline=4", "parallel.virtual_stages=2", "parallel.schedule=zero_bubble",
      "model.num_layers=8", "train.global_batch_size=6", "train.micro_batch_size=2"],
     "needs at least parallel.pipeline=4 micro batches"),
    (["model.num_experts=4", "model.moe_capacity_factor=1", "model.moe_token_drop_policy=first"],
     "model.moe_token_drop_policy='first' is not one of probs, position"),
    (["parallel.sequence_parallel=true"], "needs parallel.tensor > 1"),
    (["parallel.overlap_grad_reduce=true", "parallel.pipeline=2", "parallel.schedule=gpipe"],
     "use parallel.schedule=1f1b or interleaved, or set parallel.overlap_grad_reduce=false"),
    (["parallel.overlap_grad_reduce=true", "parallel.pipeline=2", "parallel.schedule=zero_bubble"],
     "use parallel.schedule=1f1b or interleaved"),
    (["parallel.overlap_param_gather=true", "parallel.overlap_grad_reduce=true"],
     "set parallel.data_parallel_sharding_strategy=optim and parallel.overlap_grad_reduce=true"),
    (["model.make_vocab_size_divisible_by=2", "model.vocab_size=257", "parallel.tensor=4"],
     "padded vocabulary 258 is not divisible by parallel.tensor=4"),
    (["model.hidden_size=130"], "not divisible by model.num_heads"),
    (["model.attention_impl=cudnn", "model.attention_dropout=0.1"], "use model.attention_impl=auto, pallas or xla"),
    (["data.split=90,abc"], "data.split"),
    (["model.multi_latent_attention=true"], "set model.arch=llama"),
    (["model.multi_latent_attention=true", "model.arch=llama", "model.num_kv_heads=2"], "unset model.num_kv_heads"),
    (["model.multi_latent_attention=true", "model.arch=llama", "model.add_qkv_bias=true"], "add_qkv_bias=false"),
    (["model.multi_latent_attention=true", "model.arch=llama", "model.qk_pos_emb_head_dim=3"], "positive and even"),
    (["model.multi_latent_attention=true", "model.arch=llama", "model.v_head_dim=256"], "wider than a query head"),
    (["model.multi_latent_attention=true", "model.arch=llama", "model.q_lora_rank=0"], "q_lora_rank must be"),
    (["parallel.schedule=interleaved"], "but parallel.pipeline=1: set parallel.pipeline > 1"),
    (["model.num_experts=4", "model.moe_ffn_hidden_size=30", "parallel.tensor=4"],
     "each expert's width 30 is split over parallel.tensor=4"),
    (["model.num_experts=4", "model.moe_ffn_hidden_size=30", "parallel.tensor=4", "parallel.expert_tensor=4"],
     "each expert's width 30 is split over parallel.tensor=4"),
    (["model.num_experts=4", "model.moe_ffn_hidden_size=33", "model.moe_shared_experts=1", "parallel.tensor=2",
      "parallel.expert_tensor=1", "parallel.sequence_parallel=true"],
     "the shared experts' MLP width 33 (model.moe_shared_experts=1 x the expert width 33) is split over "
     "parallel.tensor=2 and does not divide by it: set model.moe_ffn_hidden_size to a multiple of 2"),
    (["parallel.schedule=zero_bubble"], "but parallel.pipeline=1: set parallel.pipeline > 1"),
    (["parallel.vocab_over_pipeline=true"], "it needs parallel.pipeline > 1 (or set it to null)"),
    (["parallel.vocab_over_pipeline=true", "parallel.pipeline=2", "model.num_layers=2", "model.vocab_size=101",
      "model.make_vocab_size_divisible_by=1"],
     "splits the padded vocabulary 101 over parallel.pipeline x parallel.tensor = 2 ranks, which does not divide it: "
     "set model.make_vocab_size_divisible_by to a multiple of 2"),
    (["parallel.tensr=2"], "unknown config key 'parallel.tensr': did you mean 'parallel.tensor'?"),
    (["model.num_layer=2"], "did you mean 'model.num_layers'?"),
    (["optimizer.lr=1e-3"], "unknown config section 'optimizer': did you mean 'optim'? (sections: checkpoint, data, "
                            "model, optim, parallel, train)"),
    (["model.num_layers.x=1"], "config key 'model.num_layers' is a value, not a section"),
])
def test_bad_configs_name_the_fix(sets, needle):
    with pytest.raises(ConfigError, match=None) as err:
        load(*sets)
    assert needle in str(err.value), str(err.value)


def test_device_count_mismatch():
    cfg = load("parallel.data=2", "parallel.tensor=2")
    with pytest.raises(ConfigError, match="there are 8 devices: set parallel.data=4"):
        cfg.for_devices(8)
    assert load("parallel.tensor=2").for_devices(8).parallel.data == 4
    with pytest.raises(ConfigError, match="cannot be split"):
        load("parallel.tensor=4", "model.num_heads=4").for_devices(6)


def test_whole_experts_take_any_width_but_their_shared_experts_are_split():
    """parallel.expert_tensor=1 keeps each expert whole (no width check); the shared experts stay one MLP split
    over 'tensor', so their width must divide (33 x 2 does over 2, 33 x 1 does not: the test above)."""
    sets = ("model.num_experts=4", "model.moe_ffn_hidden_size=33", "parallel.tensor=2", "parallel.expert_tensor=1",
            "parallel.sequence_parallel=true")
    assert load(*sets).model.moe_ffn_size == 33
    assert load(*sets, "model.moe_shared_experts=2").model.moe_shared_experts == 2


def test_a_derived_size_before_for_devices_names_it():
    cfg = load("train.global_batch_size=8")
    assert not cfg.resolved
    with pytest.raises(ConfigError, match=r"call Config.for_devices\(num_devices\) first"):
        _ = cfg.num_micro_batches
    resolved = cfg.for_devices(8)
    assert resolved.resolved and (resolved.parallel.data, resolved.train.micro_batch_size) == (8, 1)
    assert resolved.num_micro_batches == 1 and resolved.for_devices(8) == resolved
    assert load("parallel.data=2", "train.micro_batch_size=2").num_micro_batches == 2  # set by hand: resolved


def test_field_metadata_says_what_may_change_on_resume_and_what_defines_the_model():
    """Every key, classified: the layout, checkpointing and where output goes may change when a run resumes; the
    keys of the architecture tie a checkpoint to its model (compared by their resolved values)."""
    keys = [key for key, *_ in config_io.keys_help()]
    same_run = {key for key in keys if config_lib.may_change_on_resume(key)}
    assert same_run == {key for key in keys if key.split(".")[0] in ("parallel", "checkpoint")} | {
        "model.attention_impl", "model.norm_impl", "model.recompute", "model.scan_layers", "train.log_every",
        "train.log_update_norm", "train.eval_every", "train.eval_batches", "train.output_dir", "train.max_bad_steps",
        "train.exit_after_minutes",
        "train.profile_start", "train.profile_steps", "train.wandb_project", "train.wandb_exp_name",
        "train.elastic", "train.hang_report_s", "train.hang_exit_s", "train.debug_stall",
        "data.prefetch", "data.cache_dir", "data.index_cache_dir"}
    assert not config_lib.may_change_on_resume("train.steps") and not config_lib.may_change_on_resume("nosuch.key")
    assert config_lib.model_defining_fields() == {
        "arch": "arch", "num_layers": "num_layers", "hidden_size": "hidden_size", "num_heads": "num_heads",
        "num_kv_heads": "kv_heads", "ffn_hidden_size": "ffn_size", "vocab_size": "vocab_size",
        "make_vocab_size_divisible_by": "padded_vocab_size", "norm_eps": "norm_eps", "rope_theta": "rope_theta",
        "tie_embeddings": "tied", "multi_latent_attention": "multi_latent_attention", "num_experts": "num_experts",
        "moe_layer_freq": "layer_period", "moe_first_dense_layers": "first_dense_layers",
        "moe_router_score_function": "moe_router_score_function", "mtp_num_layers": "mtp_num_layers"}


def test_interleaved_needs_at_least_p_micro_batches():
    """As Megatron: p <= micro batch group <= m, so any m >= p works (3 over p = 2 here), fewer does not."""
    sets = ("model.num_layers=4", "parallel.pipeline=2", "parallel.virtual_stages=2", "parallel.schedule=interleaved")
    assert load(*sets, "train.global_batch_size=6", "train.micro_batch_size=2").for_devices(2).num_micro_batches == 3
    with pytest.raises(ConfigError, match="at least parallel.pipeline=2 micro batches, got 1"):
        load(*sets, "train.global_batch_size=2", "train.micro_batch_size=2").for_devices(2)


def test_missing_file_and_bad_override_syntax():
    with pytest.raises(ConfigError, match="does not exist"):
        config_io.load("configs/nope.yaml")
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load("model.num_layers")


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True)))
def test_presets_load(path):
    cfg = config_io.load(path)
    assert cfg.model.num_layers > 0


def test_derived_sizes():
    llama = load("model.arch=llama", "model.hidden_size=4096", "model.num_heads=32")
    assert llama.model.ffn_size == 11008 and not llama.model.tied
    gpt = load("model.vocab_size=50257")
    assert gpt.model.padded_vocab_size == 50304 and gpt.model.tied and gpt.model.ffn_size == 4 * 128


def test_the_cli_lists_every_key_and_applies_every_set(capsys):
    """`--help` lists every config key with its type, default and whole meaning (from config.py, so a new key
    without a description fails here), and repeated --set flags all apply."""
    import argparse
    import dataclasses

    rows = config_io.keys_help()
    sections = [type(f.default) for f in dataclasses.fields(config_lib.Config)]
    assert len(rows) == sum(len(dataclasses.fields(s)) for s in sections)
    assert all(meaning for *_, meaning in rows), [k for k, *_, meaning in rows if not meaning]
    parser = argparse.ArgumentParser()
    config_io.add_cli_arguments(parser)
    helptext = parser.format_help()
    assert all(key in helptext for key, *_ in rows) and "(gpipe|1f1b|interleaved|zero_bubble, default 1f1b)" in helptext
    flat = " ".join(helptext.split())
    assert "1: every layer is MoE; n: layers 0, n, 2n, .. are MoE, the rest dense (Megatron's)" in flat  # whole text
    args = parser.parse_args(["--set", "model.num_layers=3", "--set", "optim.lr=1e-3", "train.steps=7"])
    cfg = config_io.load(args.config, args.set)
    assert (cfg.model.num_layers, cfg.optim.lr, cfg.train.steps) == (3, 1e-3, 7)


def test_the_model_and_parallel_keys_read_by_concern():
    """The model and parallel sections' keys are grouped by concern (each class's CONCERNS): every group's keys
    share it (MoE, RoPE, FP8, multi-latent attention; the mesh, the pipeline, ZeRO), and --help prints each
    title above its keys."""
    import argparse

    from megajax.config import base

    groups = {title: names for title, names in base.concerns(config_lib.ModelConfig)}
    assert all(n.startswith("moe_") for n in groups["mixture of experts"][2:])
    assert all(n.startswith("rope_") for n in groups["positions (RoPE)"])
    assert all(n.startswith("fp8") for n in groups["FP8"])
    assert groups["multi-latent attention"][0] == "multi_latent_attention"
    mesh = {title: names for title, names in base.concerns(config_lib.ParallelConfig)}
    assert mesh["the mesh"] == ["data", "pipeline", "tensor", "expert", "context"]
    assert mesh["data parallelism: ZeRO and overlap"][0] == "data_parallel_sharding_strategy"
    assert base.concerns(config_lib.TrainConfig)[0][0] is None  # a section without CONCERNS: one group
    parser = argparse.ArgumentParser()
    config_io.add_cli_arguments(parser)
    helptext = parser.format_help()
    at = [helptext.index(f"-- model: {title} --") for title in groups]
    assert at == sorted(at) and helptext.index("-- model: mixture of experts --") < helptext.index("model.num_experts")


def test_the_defaults_fit_the_default_data():
    """`python -m megajax.train` with no config trains on the bundled corpus with the byte tokenizer: the
    default vocabulary holds its end-of-document id."""
    from megajax.data import tokenizers

    cfg = config_lib.Config()
    tok = tokenizers.resolve(cfg.data.tokenizer).build()
    assert not cfg.data.paths and cfg.model.vocab_size == tok.vocab_size == 257


def test_resume_reports_every_changed_key_and_flags_those_that_change_the_run():
    from megajax import checkpoint, train

    saved = load("optim.lr=1e-3", "parallel.data=2", "train.steps=10")
    meta = checkpoint.metadata(saved, 5, 40)
    now = load("optim.lr=2e-3", "parallel.data=4", "train.steps=20", "train.log_every=1")
    changes = {key: (before, after, flagged) for key, before, after, flagged in train.config_changes(now, meta)}
    assert changes == {"optim.lr": (1e-3, 2e-3, True), "parallel.data": (2, 4, False),
                       "train.steps": (10, 20, True),  # the decay runs over train.steps (optim.decay_steps null)
                       "train.log_every": (10, 1, False)}
    lines = []
    train._report_config_changes(now, meta, type("Log", (), {"info": lambda self, m: lines.append(m)})())
    assert lines[0].startswith("resuming with 4 config key(s) changed") and any(
        "optim.lr: 0.001 -> 0.002  <- the run differs" in line for line in lines)
    assert train.config_changes(saved, meta) == []


def test_a_visible_gpu_with_a_cpu_backend_stops_training_unless_asked(monkeypatch):
    """With an NVIDIA driver present and JAX on the CPU (a CPU-only jaxlib), training stops with the fix;
    JAX_PLATFORMS=cpu or MEGAJAX_ALLOW_CPU=1 trains on the CPU on purpose."""
    from megajax import distributed

    real = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: p == "/dev/nvidiactl" or real(p))
    monkeypatch.setenv("JAX_PLATFORMS", "")
    monkeypatch.delenv("MEGAJAX_ALLOW_CPU", raising=False)
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[gpu\]'"):
        distributed.check_backend()
    monkeypatch.setenv("MEGAJAX_ALLOW_CPU", "1")
    distributed.check_backend()


def _laughs(levels: int) -> str:
    """A "billion laughs" preset: data.paths of nested YAML aliases, 10^levels strings once expanded."""
    items = ['&l0 ["x","x","x","x","x","x","x","x","x","x"]']
    items += [f"&l{i} [" + ",".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, levels + 1)]
    return "data:\n  paths: [" + ", ".join(items) + "]\n"


HOSTILE_PRESETS = {
    "billion laughs": _laughs(8),
    "a python tag": "model: !!python/object/apply:os.system ['true']\n",
    "not YAML": "model: [unclosed\n",
    "a list": "- model\n- parallel\n",
    "binary": "\x00\x01\x02\xff",
    "a mistyped key": "model:\n  num_layer: 4\n",
    "a wrong type": "parallel:\n  tensor: two\n",
}


@pytest.mark.parametrize("case", list(HOSTILE_PRESETS))
def test_a_damaged_or_hostile_preset_is_one_bounded_line_and_exit_2(tmp_path, capsys, case):
    """`python -m megajax.train --config BAD`: `error: <file>: <what>`, one line under 1,000 characters, exit 2,
    fast (the aliases are never expanded), nothing written."""
    import time

    from megajax import train

    preset = tmp_path / "bad.yaml"
    preset.write_bytes(HOSTILE_PRESETS[case].encode("utf-8", "surrogateescape")
                       if case != "binary" else HOSTILE_PRESETS[case].encode("latin-1"))
    start = time.time()
    code = train.main(["--config", str(preset), "--set", f"train.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and str(preset) in err[0], err
    assert len(err[0]) < 1000 and time.time() - start < 10
    assert not (tmp_path / "run").exists()


def test_pipeline_split_is_megatrons_for_every_stage_count_and_chunk_count():
    """config.pipeline_split over the space of (layers, p, v, first, last, embedding/loss accounting, dense first
    layers): every accepted split holds every layer once, in stage order, as Megatron's get_num_layers_to_build
    splits them; every refused one names the keys to change."""
    from megajax.config import pipeline_split

    accepted = refused = 0
    for layers, p, v in itertools.product((7, 12, 24, 61, 126), range(2, 17), (1, 2, 3)):
        for first, last, acc, dense in itertools.product((None, 1, 2, 3, 4, 7, 8), (None, 1, 2, 7), range(4),
                                                         (0, 3)):
            if acc and (first is not None or last is not None):
                continue
            try:
                split = pipeline_split(layers, p, v, first, last, bool(acc & 1), bool(acc & 2), dense)
            except ConfigError as e:
                refused += 1
                assert "parallel." in str(e) or "model." in str(e), str(e)
                continue
            accepted += 1
            assert sum(split.layers) == layers and len(split.layers) == p * v and min(split.layers) >= 1
            assert sum(split.units) == layers - dense and split.layers[0] - split.units[0] == dense
            stages = [sum(split.layers[r::p]) for r in range(p)]
            if first is not None or last is not None:
                assert all(len({split.layers[c] for c in range(r, p * v, p)}) == 1 for r in range(p)), "even chunks"
                assert first is None or stages[0] == first
                assert last is None or stages[-1] == last
                inner = stages[1:-1] + ([stages[0]] if first is None else []) + ([stages[-1]] if last is None else [])
                assert len(set(inner)) <= 1
            elif acc:
                per = (layers + bool(acc & 1) + bool(acc & 2)) // (p * v)
                assert split.layers[0] == per - bool(acc & 1) and split.layers[-1] == per - bool(acc & 2)
            else:
                assert len(set(split.units)) == 1
    assert accepted > 500 and refused > 500
    # Meta's split of Llama 3.1 405B, two ways
    assert pipeline_split(126, 16, 1, 7, 7).layers == (7,) + (8,) * 14 + (7,)
    assert pipeline_split(126, 16, 1, embedding=True, loss=True).layers == (7,) + (8,) * 14 + (7,)


@pytest.mark.parametrize("sets,words", [
    ({"parallel.decoder_first_pipeline_num_layers": 1}, "parallel.pipeline > 1"),
    ({"parallel.pipeline": 2, "parallel.decoder_first_pipeline_num_layers": 1,
      "parallel.account_for_loss_in_pipeline_split": True}, "set one or the other"),
    ({"parallel.pipeline": 2, "model.num_layers": 3}, "decoder_first_pipeline_num_layers"),
    ({"parallel.pipeline": 4, "model.num_layers": 8, "parallel.decoder_first_pipeline_num_layers": 3},
     "divides by 3"),
    ({"parallel.pipeline": 2, "parallel.schedule": "interleaved", "parallel.virtual_stages": 2, "model.num_layers": 8,
      "parallel.decoder_first_pipeline_num_layers": 3}, "multiple of 2"),
])
def test_uneven_stage_errors_name_the_fix(sets, words):
    with pytest.raises(ConfigError, match=words):
        small_config(**{"train.global_batch_size": 8, **sets})


@pytest.mark.parametrize("old, strategy", [(True, "optim"), (False, "no_shard")])
def test_the_old_distributed_optimizer_key_reads_as_the_strategy_with_a_notice(old, strategy, caplog):
    """parallel.distributed_optimizer (before parallel.data_parallel_sharding_strategy was the one key) still reads,
    in a preset or a checkpoint's config (a mapping) and in --set, as the strategy it meant, with a one-line notice
    naming the new key; where both are set, the new one decides and the notice says the old one is not read."""
    caplog.set_level("WARNING", logger="megajax.config")
    key = "parallel.data_parallel_sharding_strategy"
    assert config_io.from_dict({"parallel": {"distributed_optimizer": old}}).parallel.sharding_strategy == strategy
    assert config_io.load(None, [f"parallel.distributed_optimizer={str(old).lower()}"]).parallel.sharding_strategy \
        == strategy
    notices = [r.getMessage() for r in caplog.records]
    assert len(notices) == 2 and all(key in n and "\n" not in n for n in notices), notices
    caplog.clear()
    both = {"distributed_optimizer": old, "data_parallel_sharding_strategy": "optim_grads"}
    assert config_io.from_dict({"parallel": both}).parallel.sharding_strategy == "optim_grads"
    assert config_io.load(None, [f"{key}=optim_grads_params", f"parallel.distributed_optimizer={old}"]) \
        .parallel.sharding_strategy == "optim_grads_params"
    assert all("not read" in r.getMessage() for r in caplog.records) and len(caplog.records) == 2
    with pytest.raises(ConfigError, match="distributed_optimizer must be true or false"):
        config_io.from_dict({"parallel": {"distributed_optimizer": "yes"}})


def test_presets_use_no_old_key():
    """Every preset is written in the current keys (config.io.OLD_KEYS is for configs written before)."""
    import yaml

    for path in sorted(glob.glob(f"{REPO}/configs/**/*.yaml", recursive=True)):
        data = yaml.safe_load(open(path))
        flat = {f"{s}.{k}" for s, section in data.items() if isinstance(section, dict) for k in section}
        assert not flat & set(config_io.OLD_KEYS), path
