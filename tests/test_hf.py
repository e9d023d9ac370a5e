"""Hugging Face interop: import/export of GPT-2, Llama and Mixtral, logits parity with transformers, KV-cache
generation equal to transformers' greedy generate, params-only checkpoints and checkpoint.load_from.

The HF models are random-weight models built here from a config (no download). Their weights are
redrawn with a large spread (norm scales around 1, everything else N(0, 0.2)) so that the logits are
of order 1-10 and every tensor, biases and norms included, moves them.
"""

import dataclasses
import json
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO, cli_env, small_config

torch = pytest.importorskip("torch", reason="the parity tests need torch (pip install -e '.[test]': CPU wheel)")
transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (the test extra)")
pytest.importorskip("safetensors", reason="megajax.convert reads safetensors files (the safetensors package)")

from megajax import checkpoint, convert, generate, model  # noqa: E402

VOCAB = 300  # not a multiple of 128: the megajax vocabulary is padded to 384
CASES = {
    "gpt2-tied": dict(arch="gpt2"),
    "gpt2-untied": dict(arch="gpt2", tie_word_embeddings=False),
    "llama-gqa-untied": dict(arch="llama", num_key_value_heads=2),
    # Llama 3.2's kind: GQA, tied output, Llama 3.1's RoPE scaling (original 64 positions: at head dim 8 and theta
    # 500 the wavelengths 6, 30, 140 and 660 fall under the kept, interpolated and scaled bands)
    "llama3-gqa-tied": dict(arch="llama", num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
    "llama-mha": dict(arch="llama", num_key_value_heads=8),
    "mixtral": dict(arch="mixtral", num_key_value_heads=2),
    "qwen2-gqa": dict(arch="qwen2", num_key_value_heads=2),  # Llama with QKV biases
    # experts weighted by their probabilities without renormalising, a gated shared expert twice an expert's width
    "qwen2-moe": dict(arch="qwen2_moe", num_key_value_heads=2),
    # multi-latent attention with a query latent, a dense first layer, then sigmoid routing with a (nonzero)
    # correction bias, 4 groups of 2 experts of which each token's 4 come from its best 2, scaled weights, a shared
    # expert; interleaved RoPE
    "deepseek-v3": dict(arch="deepseek_v3", num_hidden_layers=3, first_k_dense_replace=1),
    # MLA without a query latent, dense MLPs only (first_k_dense_replace = the layers), RoPE dims in halves, YaRN
    # with DeepSeek's mscales (amplitude and softmax scale both changed; original 16 positions: its ramp is partial)
    "deepseek-v3-dense": dict(arch="deepseek_v3", q_lora_rank=None, first_k_dense_replace=2, rope_interleave=False,
                              rope_parameters=dict(rope_type="yarn", rope_theta=500.0, factor=4.0, mscale=1.0,
                                                   mscale_all_dim=0.8, original_max_position_embeddings=16)),
    "llama-yarn": dict(arch="llama", num_key_value_heads=2, rope_parameters=dict(
        rope_type="yarn", rope_theta=500.0, factor=4.0, original_max_position_embeddings=16)),
}
SHARDED_SOURCE = {"gpt2-untied", "llama-gqa-untied"}  # saved as model-0000i-of-0000n + index json


def hf_config(arch: str, **kw):
    """A small GPT-2, Llama, Mixtral (4 experts, top 2), Qwen2 or Qwen2-MoE (4 experts, top 2, shared expert) config;
    keywords override the defaults."""
    if arch == "gpt2":
        base = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=40)
        return transformers.GPT2Config(**{**base, **kw, "bos_token_id": None, "eos_token_id": None})
    base = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, intermediate_size=96, vocab_size=VOCAB,
                max_position_embeddings=64, rope_theta=500.0, rms_norm_eps=1e-5)
    if arch == "mixtral":
        base.update(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    if arch == "qwen2_moe":
        base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                    norm_topk_prob=False)
    if arch == "deepseek_v3":
        base.update(num_key_value_heads=8, rms_norm_eps=1e-6, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                    v_head_dim=6, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4, n_group=4,
                    topk_group=2, first_k_dense_replace=0, moe_intermediate_size=48, routed_scaling_factor=2.5)
    cls = {"mixtral": transformers.MixtralConfig, "qwen2": transformers.Qwen2Config,
           "qwen2_moe": transformers.Qwen2MoeConfig,
           "deepseek_v3": transformers.DeepseekV3Config}.get(arch, transformers.LlamaConfig)
    return cls(**{**base, **kw, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None})


def build_hf_model(arch: str, seed: int = 0, **kw):
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(hf_config(arch, **kw), attn_implementation="eager")
    with torch.no_grad():
        for name, p in m.named_parameters():
            is_scale = re.search(r"(ln_\w+|layernorm|norm)\.weight$", name)
            p.copy_((1.0 if is_scale else 0.0) + 0.2 * torch.randn_like(p))
        for name, b in m.named_buffers():  # DeepSeek's routing bias: a trained model's steers the choice
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return m.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """case -> (HF model, HF folder, converted megajax checkpoint)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (case, kw) in enumerate(CASES.items()):
        m = build_hf_model(seed=i, **kw)
        src = root / case
        m.save_pretrained(src, max_shard_size="40KB" if case in SHARDED_SOURCE else "1GB")
        if case in SHARDED_SOURCE:
            assert (src / "model.safetensors.index.json").exists()
        convert.from_hf(src, root / f"{case}-megajax", config_out=root / f"{case}.yaml")
        out[case] = (m, src, root / f"{case}-megajax")
    return out


def _tokens(seed: int = 0, b: int = 2, s: int = 24) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (b, s))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(models, case):
    hf_model, _, ckpt = models[case]
    source = checkpoint.find_params(ckpt)
    cfg = source.config.model
    assert source.config.data.tokenizer == convert.NO_TOKENIZER  # no tokenizer files: none rather than a wrong one
    assert cfg.padded_vocab_size == 384 and cfg.tied == CASES[case].get("tie_word_embeddings", case.startswith("gpt2"))
    params = checkpoint.load_params(source)
    tokens = _tokens()
    ours = np.asarray(jax.jit(model.GPT(cfg).apply)({"params": params}, tokens))
    with torch.no_grad():
        ref = hf_model(torch.tensor(tokens)).logits.numpy()
    diff = np.abs(ours[..., :VOCAB] - ref).max()
    print(f"{case}: max |logit| {np.abs(ref).max():.2f}, max abs difference {diff:.2e}")
    assert np.abs(ref).max() > 3, "the test model should have logits well away from zero"
    assert diff < 1e-4


@pytest.mark.parametrize("case", ["gpt2-tied", "gpt2-untied", "llama-gqa-untied", "llama3-gqa-tied", "mixtral",
                                  "qwen2-gqa", "qwen2-moe", "deepseek-v3"])
def test_export_then_reload_reproduces_the_weights(models, case, tmp_path):
    hf_model, src, ckpt = models[case]
    files = convert.to_hf(ckpt, tmp_path / "out", max_shard_size="30KB" if "tied" in case else "5GB")
    assert ("model.safetensors.index.json" in files) == ("tied" in case)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(again) is type(hf_model)
    want, got = hf_model.state_dict(), again.state_dict()
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["tie_word_embeddings"] == hf_model.config.tie_word_embeddings


def test_original_gpt2_tensor_names_and_buffers(models, tmp_path):
    """OpenAI's GPT-2 files have no 'transformer.' prefix and carry the causal-mask buffers."""
    from safetensors.numpy import load_file, save_file

    _, src, ckpt = models["gpt2-tied"]
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(src / "model.safetensors").items()}
    tensors["h.0.attn.bias"] = np.tril(np.ones((1, 1, 40, 40), np.float32))
    (tmp_path / "src").mkdir()
    save_file(tensors, tmp_path / "src" / "model.safetensors")
    (tmp_path / "src" / "config.json").write_text((src / "config.json").read_text())
    convert.from_hf(tmp_path / "src", tmp_path / "ckpt")
    a, b = checkpoint.load_params(ckpt), checkpoint.load_params(tmp_path / "ckpt")
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_bfloat16_weights(models, tmp_path):
    """bfloat16 safetensors (most released Llamas) import exactly into fp32 params and export back to bf16."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    hf_model, src, _ = models["llama3-gqa-tied"]
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(src / "model.safetensors").items()}
    (tmp_path / "src").mkdir()
    save_file(bf16, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "src" / "config.json").write_text((src / "config.json").read_text())
    convert.from_hf(tmp_path / "src", tmp_path / "ckpt")
    params = checkpoint.load_params(tmp_path / "ckpt")
    assert params["embed"]["embedding"].dtype == np.float32
    np.testing.assert_array_equal(params["embed"]["embedding"][:VOCAB],
                                  bf16["model.embed_tokens.weight"].astype(np.float32))
    convert.to_hf(tmp_path / "ckpt", tmp_path / "out", dtype="bfloat16")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    got = {k: v.float().numpy() for k, v in again.state_dict().items()}
    for name, w in bf16.items():
        np.testing.assert_array_equal(got[name], w.astype(np.float32), err_msg=name)


def _convert_error(capsys, args) -> str:
    assert convert.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    return err


def test_conversion_errors_name_the_problem(models, tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    _, src, _ = models["llama3-gqa-tied"]
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())

    def folder(name, cfg=config, drop=(), add=None):
        d = tmp_path / name
        d.mkdir()
        save_file({k: v for k, v in {**tensors, **(add or {})}.items() if k not in drop}, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps(cfg))
        return ["from-hf", "--model", str(d), "--output", str(tmp_path / f"{name}-out")]

    err = _convert_error(capsys, folder("bert", {**config, "model_type": "bert", "architectures": ["BertModel"]}))
    assert "unknown architecture" in err and "bert" in err
    err = _convert_error(capsys, folder("cls", {**config, "architectures": ["LlamaForSequenceClassification"]}))
    assert "LlamaForSequenceClassification" in err
    err = _convert_error(capsys, folder("missing", drop={"model.layers.1.mlp.up_proj.weight"}))
    assert "missing tensor 'model.layers.1.mlp.up_proj.weight'" in err
    err = _convert_error(capsys, folder("shape", {**config, "intermediate_size": 128}))
    assert "model.layers.0.mlp.gate_proj.weight" in err and "(96, 64)" in err and "(128, 64)" in err
    extra = {"model.layers.2.input_layernorm.weight": np.ones(64, np.float32)}
    err = _convert_error(capsys, folder("extra", add=extra))
    assert "unexpected tensor 'model.layers.2.input_layernorm.weight'" in err
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}
    err = _convert_error(capsys, folder("rope", {**config, "rope_parameters": rope}))
    assert "'longrope' is not supported" in err
    err = _convert_error(capsys, ["to-hf", "--checkpoint", str(tmp_path), "--output", str(tmp_path / "x")])
    assert "is not a megajax checkpoint" in err


@pytest.mark.parametrize("case", ["gpt2-untied", "llama-gqa-untied", "mixtral", "qwen2-moe", "deepseek-v3"])
def test_kv_cache_decoding_matches_the_full_forward(models, case):
    """Prefill (in two chunks) + one-token steps through the cache give the full forward's logits."""
    source = checkpoint.find_params(models[case][2])
    cfg, params = source.config.model, checkpoint.load_params(source)
    tokens = _tokens(s=16)
    full = np.asarray(jax.jit(model.GPT(cfg).apply)({"params": params}, tokens))
    step = jax.jit(lambda p, t, s: model.decode_apply(cfg, p, t, s))
    state = model.init_decode_state(cfg, 2, 20)
    for lo, hi in [(0, 5), (5, 9)] + [(i, i + 1) for i in range(9, 16)]:
        logits, state = step(params, tokens[:, lo:hi], state)
        np.testing.assert_allclose(np.asarray(logits), full[:, hi - 1], atol=2e-5, rtol=0, err_msg=f"position {hi - 1}")
    assert int(state.length) == 16
    assert step._cache_size() == 3  # one program per input length (5, 4, 1), none per position


# suite time: Mixtral's, Qwen2-MoE's and the dense DeepSeek's with -m slow (their KV-cache decoding runs by default)
@pytest.mark.parametrize("case", ["gpt2-untied", "llama-gqa-untied",
                                  # suite time: DeepSeek-V3's decoding is checked by default against the forward
                                  *(pytest.param(c, marks=pytest.mark.slow)
                                    for c in ("deepseek-v3", "mixtral", "qwen2-moe", "deepseek-v3-dense"))])
def test_greedy_generation_matches_transformers(models, case, capsys):
    hf_model, _, ckpt = models[case]
    prompt = [5, 17, 250, 3, 99]
    n = 30
    assert generate.main(["--checkpoint", str(ckpt), "--prompt-ids", ",".join(map(str, prompt)),
                          "--max-new-tokens", str(n), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    assert out["ids"] == ref[0, len(prompt):].tolist()
    assert out["text"] is None and out["new_tokens"] == n and out["tokens_per_s"] > 0


def test_sampling_settings():
    logits = jax.random.normal(jax.random.key(0), (4, 384)) * 3
    greedy = generate.sample_next(logits, jax.random.key(1), generate.Sampling(), 300)
    assert (np.asarray(greedy) < 300).all()
    np.testing.assert_array_equal(greedy, np.argmax(np.asarray(logits)[:, :300], -1))
    for s in (generate.Sampling(1.0, top_k=1), generate.Sampling(1.0, top_p=1e-6)):
        np.testing.assert_array_equal(generate.sample_next(logits, jax.random.key(1), s, 300), greedy)
    sample = jax.jit(generate.sample_next, static_argnums=(2, 3))
    s = generate.Sampling(1.0, top_k=5)
    draws = np.stack([sample(logits, jax.random.key(i), s, 300) for i in range(50)])
    top5 = np.argsort(-np.asarray(logits)[:, :300], -1)[:, :5]
    assert all(set(draws[:, r]) <= set(top5[r]) for r in range(4)) and len(set(draws[:, 0])) > 1
    with pytest.raises(ValueError, match="top-p"):
        generate.Sampling(1.0, top_p=0)


def test_gpt2_generation_longer_than_positions_is_an_error(models, capsys):
    _, _, ckpt = models["gpt2-tied"]
    assert generate.main(["--checkpoint", str(ckpt), "--prompt-ids", "1,2,3", "--max-new-tokens", "39"]) == 2
    assert "seq_length=40" in capsys.readouterr().err


def test_pipeline_staged_training_checkpoint_exports(tmp_path):
    """A training state with pipeline (and interleaved) stages stores layers as [v, p, L/(p v), ...];
    export and load_params give the canonical [L, ...] layers back."""
    from megajax import step as step_lib
    from megajax.config import io as config_io
    from megajax.parallel.pipeline.layout import from_stages

    setup = step_lib.setup_for(small_config(**{
        "model.num_layers": 4, "parallel.pipeline": 2, "parallel.virtual_stages": 2, "parallel.schedule": "interleaved",
        "train.global_batch_size": 4, "train.micro_batch_size": 1, "model.vocab_size": VOCAB,
        "train.output_dir": str(tmp_path / "run")}), jax.devices()[:2])
    cfg = setup.cfg
    state = step_lib.init_state(setup)
    assert state.params["layers"]["block"]["attn"]["wqkv"].shape[:3] == (2, 2, 1)
    mgr = checkpoint.manager_for(cfg)
    checkpoint.save(mgr, 7, state, cfg, 28)
    mgr.wait_until_finished()
    mgr.close()
    want = from_stages(jax.tree.map(np.asarray, state.params), cfg.stage_split)
    got = checkpoint.load_params(tmp_path / "run")  # the output dir: its checkpoints/, newest step
    jax.tree.map(np.testing.assert_array_equal, got, want)
    convert.to_hf(tmp_path / "run", tmp_path / "hf")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = _tokens(b=1, s=16)
    ours = np.asarray(model.GPT(cfg.model).apply({"params": want}, tokens))[..., :VOCAB]
    with torch.no_grad():
        np.testing.assert_allclose(exported(torch.tensor(tokens)).logits.numpy(), ours, atol=1e-5)
    # checkpoint.load_from onto another layout (no pipeline) and onto the staged one.
    for layout in ({"parallel.pipeline": 1, "parallel.virtual_stages": 1, "parallel.schedule": "1f1b"},
                   {"parallel.pipeline": 2, "parallel.virtual_stages": 2, "parallel.schedule": "interleaved"}):
        other = step_lib.setup_for(config_io.override(cfg, layout), jax.devices()[:layout["parallel.pipeline"]])
        state = step_lib.init_state(other, step_lib.load_initial_params(other, str(tmp_path / "run")))
        loaded = from_stages(state.params, other.cfg.stage_split) if layout["parallel.pipeline"] > 1 else state.params
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), loaded, want)


def _train_one_step_from_import(tmp_path):
    """Imports a random GPT-2 (byte vocabulary), trains one step from it with the written preset."""
    from megajax import train
    from megajax.config import io as config_io

    build_hf_model("gpt2", seed=3, vocab_size=257, n_positions=32).save_pretrained(tmp_path / "src")
    convert.from_hf(tmp_path / "src", tmp_path / "ckpt", config_out=tmp_path / "ft.yaml")
    cfg = config_io.load(tmp_path / "ft.yaml", [
        "train.steps=1", "train.global_batch_size=8", "train.log_every=1", f"train.output_dir={tmp_path / 'run'}",
        "model.dropout=0.0", "model.attention_dropout=0.0", "checkpoint.async=false", "model.compute_dtype=float32",
        "model.recompute=none", "parallel.distributed_optimizer=false"])  # the weights, not the preset's layout
    assert cfg.checkpoint.load_from == str(tmp_path / "ckpt")
    return cfg, train.run(cfg)


def test_training_starts_from_an_imported_checkpoint(tmp_path):
    """checkpoint.load_from: the first step's loss is the imported model's loss on that batch, and a
    checkpoint of another architecture is refused by name."""
    from megajax import config as config_lib, step as step_lib, train
    from megajax.config import io as config_io
    from megajax.data.loader import build_datasets, global_batch

    cfg, summary = _train_one_step_from_import(tmp_path)
    params = checkpoint.load_params(tmp_path / "ckpt")
    setup = step_lib.setup_for(cfg)
    data = build_datasets(setup.cfg, {"train": 8})["train"]
    batch = jax.device_get(global_batch(data, 0, 8, setup.batch_shardings))
    want = float(model.loss_sum(cfg.model, params, batch, None) / batch["loss_mask"].sum())
    print(f"first loss {summary['last']['loss']:.6f}, imported model's loss on that batch {want:.6f}")
    assert summary["last"]["loss"] == pytest.approx(want, rel=1e-5)
    assert want > np.log(257) + 1, "a random-init model would start near ln(257)"

    with pytest.raises(config_lib.ConfigError, match="model.norm_eps"):
        train.run(config_io.override(cfg, {"model.norm_eps": 1e-6, "train.output_dir": str(tmp_path / "other")}))


@pytest.mark.slow
def test_resume_takes_precedence_over_load_from(tmp_path):
    from megajax import train
    from megajax.config import io as config_io

    cfg, _ = _train_one_step_from_import(tmp_path)
    resumed = train.run(config_io.override(cfg, {"train.steps": 2}))
    assert resumed["steps_run"] == 1  # resumed at step 1: load_from was not applied again


def _generate_json(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "megajax.generate", *args, "--json"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.slow
def test_tiny_model_generates_corpus_text(tmp_path):
    """Train configs/tiny.yaml (800 steps, about three minutes on 2 cores) and sample from it: the bytes are
    text and most words are the corpus's. Its greedy continuation equals transformers' on the exported model.

    After 800 steps (eval loss ~1.7 nats/byte) the model writes the corpus' verse layout and common words,
    not sense: greedy decoding settles into loops such as "the LORD the LORD"; sampling gives KJV-like salad.
    """
    import gzip

    from megajax.data.corpus import CORPUS_FILE

    def documents():
        with gzip.open(CORPUS_FILE, "rt", encoding="utf-8") as f:
            return [json.loads(line)["text"] for line in f]

    run = subprocess.run([sys.executable, "-m", "megajax.train", "--config", "configs/tiny.yaml", "--set",
                          f"train.output_dir={tmp_path / 'tiny'}", "train.eval_every=0"],
                         cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-2000:]
    prompt = "And the LORD said unto Moses, "
    sampled = _generate_json("--checkpoint", str(tmp_path / "tiny"), "--prompt", prompt, "--max-new-tokens", "90",
                             "--temperature", "0.5", "--top-k", "10", "--num-samples", "3", "--seed", "0")
    text = " ".join(s["text"] for s in sampled["samples"])
    print(repr(text), f"{sampled['tokens_per_s']:.0f} tokens/s")
    corpus_words = set()
    for doc in documents():
        corpus_words.update(re.findall(r"[A-Za-z]+", doc))
    words = re.findall(r"[A-Za-z]+", text)
    known = [w for w in words if w in corpus_words]
    assert sum(c.isascii() and (c.isprintable() or c == "\n") for c in text) >= 0.95 * len(text)
    # An untrained byte model emits mostly unprintable bytes; this one writes words, a third or more of them
    # (0.49 measured) real.
    assert len(words) >= 20 and len(known) >= 0.35 * len(words), text
    assert len({w for w in known if len(w) >= 3}) >= 5, text

    greedy = _generate_json("--checkpoint", str(tmp_path / "tiny"), "--prompt", prompt, "--max-new-tokens", "90")
    convert.to_hf(tmp_path / "tiny", tmp_path / "hf")
    hfm = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = greedy["prompt_ids"]
    with torch.no_grad():
        ref = hfm.generate(torch.tensor([ids]), max_new_tokens=90, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert greedy["ids"] == ref[0, len(ids):len(ids) + len(greedy["ids"])].tolist()


def test_mixture_of_experts_conversion_errors():
    """MoE converts as Mixtral or Qwen2-MoE: a GPT-2 MoE, ungated shared experts, Qwen's routing without a shared
    expert, dense layers between the MoE ones, Qwen2-MoE's own dense-layer patterns, a shared width that is not a
    whole number of experts and a sliding window are refused with the field to change."""
    from megajax import hf
    from megajax.config import ModelConfig

    for cfg, want in ((ModelConfig(arch="gpt2", num_experts=4), "model.arch=llama"),
                      (ModelConfig(arch="llama", num_experts=4, moe_shared_experts=1), "moe_shared_experts"),
                      (ModelConfig(arch="llama", num_experts=4, moe_layer_freq=2), "moe_layer_freq")):
        with pytest.raises(hf.ConversionError, match=want):
            hf.hf_config_from_model(cfg)
        with pytest.raises(hf.ConversionError, match=want):
            hf.rules(cfg)
    pre_softmax = ModelConfig(arch="llama", num_experts=4, moe_router_pre_softmax=True)
    with pytest.raises(hf.ConversionError, match="moe_router_pre_softmax"):
        hf.rules(pre_softmax)
    qwen = hf_config("qwen2_moe").to_dict()
    for change, want in (({"decoder_sparse_step": 2}, "decoder_sparse_step"), ({"mlp_only_layers": [1]}, "mlp_only"),
                         ({"shared_expert_intermediate_size": 100}, "not a positive multiple"),
                         ({"use_sliding_window": True}, "use_sliding_window")):
        with pytest.raises(hf.ConversionError, match=want):
            hf.model_config_from_hf({**qwen, **change})
    mixtral = hf_config("mixtral").to_dict()
    with pytest.raises(hf.ConversionError, match="sliding_window"):
        hf.model_config_from_hf({**mixtral, "sliding_window": 16})
    cfg = hf.model_config_from_hf(mixtral)
    assert (cfg.arch, cfg.num_experts, cfg.experts_per_token, cfg.moe_ffn_size) == ("llama", 4, 2, 96)


def test_llama_3_2_1b_config_json_gives_the_preset():
    """The released config.json of meta-llama/Llama-3.2-1B (its fields as published) imports as
    configs/llama3.2-1b.yaml's model, apart from the training choices (sequence length, dtype, recompute)."""
    from megajax import hf
    from megajax.config import io as config_io

    released = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
                "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
                "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
                "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
                "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
                "vocab_size": 128256}
    got = hf.model_config_from_hf(released)
    preset = config_io.load(f"{REPO}/configs/llama3.2-1b.yaml").model
    training = ("seq_length", "compute_dtype", "recompute")
    differ = {f.name for f in dataclasses.fields(got) if getattr(got, f.name) != getattr(preset, f.name)}
    assert differ <= set(training), differ
    assert got.tied and got.rope_scaling == "llama3" and got.head_dim == 64
    assert hf.hf_config_from_model(got)["rope_parameters"] == {**released["rope_scaling"], "rope_theta": 500000.0}


def test_written_preset_fine_tunes_as_it_is(tmp_path):
    """`from-hf --config-out`: a complete fine-tuning preset (bf16, fine-tuning schedule, a sequence length a GPU
    holds, the tokenizer, a layout) that `python -m megajax.train` runs with nothing but steps and the output
    changed, loss finite and checkpoint written."""
    from megajax.config import io as config_io

    build_hf_model("llama", seed=4, vocab_size=257, max_position_embeddings=131072).save_pretrained(tmp_path / "big")
    convert.from_hf(tmp_path / "big", tmp_path / "big-megajax", config_out=tmp_path / "big.yaml")
    big = config_io.load(tmp_path / "big.yaml")
    assert big.model.seq_length == convert.FINE_TUNE_SEQ_LENGTH and big.model.compute_dtype == "bfloat16"
    assert big.optim.lr <= 3e-5 and big.optim.decay == "cosine" and big.parallel.sharding_strategy == "optim"
    assert big.checkpoint.load_from == str(tmp_path / "big-megajax") and "megajax.audit" in (tmp_path / "big.yaml"
                                                                                            ).read_text()

    build_hf_model("gpt2", seed=5, vocab_size=257, n_positions=32).save_pretrained(tmp_path / "src")
    convert.main(["from-hf", "--model", str(tmp_path / "src"), "--output", str(tmp_path / "ckpt"),
                  "--config-out", str(tmp_path / "ft.yaml")])
    run = subprocess.run([sys.executable, "-m", "megajax.train", "--config", str(tmp_path / "ft.yaml"), "--set",
                          "train.steps=2", f"train.output_dir={tmp_path / 'run'}"], capture_output=True, text=True,
                         timeout=600, env=cli_env(XLA_FLAGS="--xla_force_host_platform_device_count=1"))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(np.isfinite(r["loss"]) for r in rows if "loss" in r)
    assert (tmp_path / "run" / "checkpoints").is_dir()


@pytest.mark.parametrize("preset, tensor", [("llama3-8b", 2), ("llama3-70b", 8)])
def test_written_preset_picks_a_node_layout_by_size(preset, tensor):
    """The preset's tensor size keeps weights, gradients and optimizer state under 48 GB of an 80 GB GPU on one
    node: Llama 3 8B at tensor 2 (ZeRO-1 over the node), 70B at the node's 8 (and the comment asks for a pipeline)."""
    from megajax.config import io as config_io

    cfg = config_io.load(f"{REPO}/configs/{preset}.yaml")
    assert convert._node_tensor_size(cfg) == tensor


def _safetensors(header: dict | bytes, data: bytes, claimed: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (claimed if claimed is not None else len(raw)).to_bytes(8, "little") + raw + data


GOOD_TENSOR = {"transformer.wte.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
HOSTILE_FOLDERS = {
    "header claims 2^62 bytes": {"model.safetensors": _safetensors(GOOD_TENSOR, bytes(16), claimed=2**62)},
    "header past the end": {"model.safetensors": _safetensors(GOOD_TENSOR, bytes(16), claimed=10_000)},
    "header not JSON": {"model.safetensors": _safetensors(b"{not json", bytes(16))},
    "shape disagrees with the bytes": {"model.safetensors": _safetensors(
        {"transformer.wte.weight": {"dtype": "F32", "shape": [3, 3], "data_offsets": [0, 16]}}, bytes(16))},
    "offsets past the end": {"model.safetensors": _safetensors(
        {"transformer.wte.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 1 << 40]}}, bytes(16))},
    "unknown dtype": {"model.safetensors": _safetensors(
        {"transformer.wte.weight": {"dtype": "X9", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(16))},
    "index without weight_map": {"model.safetensors.index.json": b'{"metadata": {}}'},
    "index not JSON": {"model.safetensors.index.json": b'{"weight_map": '},
    "index names a file outside": {"model.safetensors.index.json": json.dumps(
        {"weight_map": {"transformer.wte.weight": "../../etc/passwd"}}).encode()},
    "config.json not JSON": {"config.json": b"{'model_type': 'gpt2'"},
    "config.json a list": {"config.json": b"[1, 2]"},
    "config.json without vocab_size": {"config.json": json.dumps({"model_type": "gpt2", "n_layer": 1}).encode()},
}


@pytest.mark.parametrize("case", list(HOSTILE_FOLDERS))
def test_a_damaged_or_hostile_hf_folder_is_one_line_and_exit_2(tmp_path, capsys, case):
    """Each reader of a Hugging Face folder (config.json, the index, the safetensors header and offsets) refuses a
    damaged or hostile file fast, with `error: <file>: <what>` (bounded) and exit 2, and writes nothing."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                 "n_layer": 1, "n_embd": 4, "n_head": 2, "vocab_size": 2,
                                                 "n_positions": 8}))
    for name, data in HOSTILE_FOLDERS[case].items():
        (src / name).write_bytes(data)
    code = convert.main(["from-hf", "--model", str(src), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and len(err[0]) < 500, err
    assert str(src) in err[0]
    assert not (tmp_path / "out").exists()


def _with_mtp_layer(hf_model, src, seed: int = 5) -> dict:
    """Adds DeepSeek-V3's multi-token prediction layer (layer num_hidden_layers: its norms, eh_proj, a decoder layer
    with experts, shared_head's norm, and its copies of the embedding and output layer) to the saved folder `src`,
    as DeepSeek's checkpoint holds it (transformers neither builds nor saves it), and sets
    num_nextn_predict_layers=1. Returns the folder's tensors."""
    from safetensors.numpy import load_file, save_file

    n = hf_model.config.num_hidden_layers
    donor = build_hf_model(seed=seed, **{**CASES["deepseek-v3"], "num_hidden_layers": n + 1})  # its layer n
    p = f"model.layers.{n}."
    donor.save_pretrained(src / "donor")  # (as save_pretrained names each expert's tensors)
    tensors = load_file(src / "model.safetensors")
    tensors.update({k: v for k, v in load_file(src / "donor" / "model.safetensors").items() if k.startswith(p)})
    d = hf_model.config.hidden_size
    rng = np.random.default_rng(seed)
    tensors.update({p + "enorm.weight": 1 + 0.2 * rng.standard_normal(d, np.float32),
                    p + "hnorm.weight": 1 + 0.2 * rng.standard_normal(d, np.float32),
                    p + "eh_proj.weight": 0.2 * rng.standard_normal((d, 2 * d), np.float32),
                    p + "shared_head.norm.weight": 1 + 0.2 * rng.standard_normal(d, np.float32),
                    p + "embed_tokens.weight": tensors["model.embed_tokens.weight"],
                    p + "shared_head.head.weight": tensors["lm_head.weight"]})
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    import shutil

    shutil.rmtree(src / "donor")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return tensors


def test_deepseek_v3_multi_token_prediction_converts_both_ways(tmp_path):
    from safetensors.numpy import load_file

    hf_model = build_hf_model(**CASES["deepseek-v3"])
    src = tmp_path / "src"
    hf_model.save_pretrained(src)
    tensors = _with_mtp_layer(hf_model, src)
    convert.from_hf(src, tmp_path / "megajax")
    source = checkpoint.find_params(tmp_path / "megajax")
    cfg = source.config.model
    assert cfg.mtp_num_layers == 1
    params = checkpoint.load_params(source)
    np.testing.assert_array_equal(params["mtp_1"]["eh_proj"], tensors["model.layers.3.eh_proj.weight"].T)
    tokens = _tokens()
    ours = np.asarray(jax.jit(model.GPT(cfg).apply)({"params": params}, tokens))
    with torch.no_grad():
        ref = hf_model(torch.tensor(tokens)).logits.numpy()
    assert np.abs(ours[..., :VOCAB] - ref).max() < 1e-4  # the main logits, with the module beside them
    convert.to_hf(tmp_path / "megajax", tmp_path / "out")
    again = load_file(tmp_path / "out" / "model.safetensors")
    assert set(again) == set(tensors)
    for name, want in tensors.items():
        np.testing.assert_array_equal(again[name], want, err_msg=name)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_a_multi_token_prediction_layer_with_its_own_head_is_refused(tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    hf_model = build_hf_model(**CASES["deepseek-v3"])
    hf_model.save_pretrained(tmp_path / "src")
    _with_mtp_layer(hf_model, tmp_path / "src")
    tensors = load_file(tmp_path / "src" / "model.safetensors")
    tensors["model.layers.3.shared_head.head.weight"] = tensors["model.layers.3.shared_head.head.weight"] + 1
    save_file(tensors, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()  # (save_pretrained's progress)
    message = _convert_error(capsys, ["from-hf", "--model", str(tmp_path / "src"), "--output", str(tmp_path / "out")])
    assert "model.layers.3.shared_head.head.weight" in message and "share the model's embedding" in message


def _block_fp8(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """w [r, c] as DeepSeek-V3 releases its weights: e4m3, and one fp32 factor a block x block block
    (its amax / 448: weight = e4m3 value x factor)."""
    import ml_dtypes

    r, c = w.shape
    padded = np.pad(w, ((0, -r % block), (0, -c % block)))
    blocks = padded.reshape(padded.shape[0] // block, block, padded.shape[1] // block, block)
    factor = np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-12) / 448.0
    spread = np.repeat(np.repeat(factor, block, axis=0), block, axis=1)[:r, :c]
    return (w / spread).astype(ml_dtypes.float8_e4m3fn), factor.astype(np.float32)


def test_deepseek_v3_fp8_folder_converts_dequantized(tmp_path, capsys):
    """DeepSeek-V3's released folders hold every linear layer's weight in e4m3 beside `<name>_scale_inv`, one fp32
    factor a 128 x 128 block (config.json's quantization_config), the router, norms, embedding and output layer in
    bf16. Converted, each weight is its FP8 value times its block's factor: the same checkpoint as converting a
    folder of those products (here at blocks of 16, so that the small weights hold several and partial ones). The
    export is unquantized and says nothing of FP8; a scale of the wrong shape, or an FP8 weight without one, is a
    one-line error."""
    from safetensors.numpy import load_file, save_file

    hf_model = build_hf_model(**CASES["deepseek-v3"])
    hf_model.save_pretrained(tmp_path / "bf16")
    capsys.readouterr()  # (save_pretrained's progress)
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    config = {**json.loads((tmp_path / "bf16" / "config.json").read_text()), "num_nextn_predict_layers": 0}
    linear = re.compile(r"(self_attn\.\w+_proj\w*|mlp\.(experts\.\d+\.|shared_experts\.)?\w+_proj)\.weight$")
    fp8, dequantized = {}, {}
    for name, w in tensors.items():
        if linear.search(name):
            q, factor = _block_fp8(w.astype(np.float32), 16)
            fp8[name], fp8[name + "_scale_inv"] = q, factor
            spread = np.repeat(np.repeat(factor, 16, axis=0), 16, axis=1)
            dequantized[name] = q.astype(np.float32) * spread[:w.shape[0], :w.shape[1]]
        else:
            fp8[name] = dequantized[name] = w
    assert sum(n.endswith("_scale_inv") for n in fp8) >= 20
    for folder, weights, extra in (("fp8", fp8, {"quantization_config": {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [16, 16]}}),
            ("plain", dequantized, {})):
        (tmp_path / folder).mkdir()
        save_file(weights, tmp_path / folder / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / folder / "config.json").write_text(json.dumps({**config, **extra}))
        convert.from_hf(tmp_path / folder, tmp_path / f"{folder}-megajax")
    got = checkpoint.load_params(checkpoint.find_params(tmp_path / "fp8-megajax"))
    want = checkpoint.load_params(checkpoint.find_params(tmp_path / "plain-megajax"))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    convert.to_hf(tmp_path / "fp8-megajax", tmp_path / "out")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    assert not any(n.endswith("_scale_inv") for n in load_file(tmp_path / "out" / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    for change, match in (({name + "_scale_inv": fp8[name + "_scale_inv"][:1]}, "weight_block_size"),
                          ({name + "_scale_inv": None}, "no block scales")):
        broken = {k: v for k, v in {**fp8, **change}.items() if v is not None}
        save_file(broken, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
        message = _convert_error(capsys, ["from-hf", "--model", str(tmp_path / "fp8"), "--output",
                                          str(tmp_path / "broken"), "--force"])
        assert name in message and match in message and message.count("\n") == 1, message
