"""`python -m megajax.convert from-hf | to-hf`: Hugging Face weights <-> megajax checkpoints.

Six architectures convert both ways: GPT-2, Llama (Llama 2/3/3.1/3.2), Mixtral, Qwen2, Qwen2-MoE and DeepSeek-V3.


    python -m megajax.convert from-hf --model HF_DIR --output CKPT_DIR [--config-out configs/x.yaml]
    python -m megajax.convert to-hf --checkpoint CKPT_DIR --output HF_DIR [--dtype bfloat16]

from-hf reads config.json and model.safetensors (or the shards listed in model.safetensors.index.json) and
writes a params-only checkpoint (megajax.checkpoint.save_params) with its config.yaml; the HF config and
tokenizer files are kept in CKPT_DIR/hf/ so that to-hf gives them back. --config-out writes a complete
fine-tuning preset that starts from the checkpoint (checkpoint.load_from): bf16, a fine-tuning learning rate
and schedule, a sequence length a GPU holds, the tokenizer, a layout for one node of 8 GPUs, comments on what to
change. to-hf takes a converted checkpoint or a
training checkpoint (its newest step, pipeline-staged or not) and writes a folder that
transformers.AutoModelForCausalLM.from_pretrained loads. Neither direction needs torch.
"""

from __future__ import annotations

if __name__ == "__main__":  # pick the platform before JAX is imported (it reads JAX_PLATFORMS at import)
    from megajax.distributed import prefer_cpu_without_gpu

    prefer_cpu_without_gpu()

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path

import absl.logging
import jax
import yaml

from megajax import checkpoint, hf
from megajax.config import Config, ConfigError, DataConfig, ModelConfig
from megajax.data.tokenizers import get_tokenizer

HF_SUBDIR = "hf"  # inside a converted checkpoint: the source's config.json and tokenizer files
NO_TOKENIZER = "none"  # data.tokenizer of a converted model that came without tokenizer files


def _expected_shapes(cfg) -> dict:
    """The parameter shapes the megajax model builds for `cfg` (nothing allocated)."""
    from megajax import model

    return model.abstract_params(cfg)


def _parameters(model_cfg) -> int:
    return sum(math.prod(a.shape) for a in jax.tree.leaves(_expected_shapes(model_cfg)))


def _prepare_output(path: Path, force: bool) -> None:
    if path.exists() and any(path.iterdir()):
        ours = (path / checkpoint.CONFIG_FILE).exists() or (path / "config.json").exists()
        if not (force and ours):
            raise FileExistsError(f"output {path} already exists and is not empty: choose a new directory"
                                  + (" or pass --force to replace it" if ours else ""))
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)


def from_hf(model_dir: str | Path, output: str | Path, config_out: str | Path | None = None,
            force: bool = False) -> Config:
    """Converts an HF folder into a params-only megajax checkpoint; returns the megajax config."""
    model_dir, output = Path(model_dir), Path(output).absolute()
    hf_cfg = hf.read_hf_config(model_dir)
    try:
        model_cfg = hf.model_config_from_hf(hf_cfg)
    except hf.ConversionError as e:
        raise hf.ConversionError(f"{model_dir / 'config.json'}: {e}") from None
    block = (hf_cfg.get("quantization_config") or {}).get("weight_block_size") or (128, 128)
    reader = hf.SafetensorsReader(model_dir, model_cfg.arch, tuple(block))
    model_cfg = _without_absent_mtp(model_cfg, reader.names())
    params = hf.params_from_hf(model_cfg, reader.get, reader.names(), source=str(model_dir),
                               rope_interleave=hf_cfg.get("rope_interleave", True))
    checkpoint.check_params_fit(params, _expected_shapes(model_cfg), str(model_dir))

    _prepare_output(output, force)
    side = output / HF_SUBDIR
    side.mkdir()
    (side / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    for name in hf.SIDE_FILES:
        if (model_dir / name).exists():
            shutil.copy2(model_dir / name, side / name)
    # A tokenizer.json beside the weights becomes the data tokenizer (for training and generation). Without
    # one, a 257-token vocabulary is taken for a byte-level model exported by megajax; anything else gets
    # no tokenizer rather than a wrong one (generation then takes --prompt-ids or --tokenizer).
    if (side / "tokenizer.json").exists():
        tokenizer = str(side / "tokenizer.json")
    else:
        tokenizer = "byte" if model_cfg.vocab_size == get_tokenizer("byte").vocab_size else NO_TOKENIZER
    cfg = Config(model=model_cfg, data=DataConfig(tokenizer=tokenizer))
    checkpoint.save_params(output, params, cfg)
    if config_out is not None:
        write_preset(cfg, output, Path(config_out))
    return cfg


def _without_absent_mtp(cfg: ModelConfig, names) -> ModelConfig:
    """`cfg` without multi-token prediction modules where config.json counts some (num_nextn_predict_layers:
    transformers writes 1 by default) but the folder holds none of their layers (transformers neither builds nor
    saves them), with a note."""
    if not cfg.mtp_num_layers or f"model.layers.{cfg.num_layers}.eh_proj.weight" in set(names):
        return cfg
    print(f"note: config.json has num_nextn_predict_layers={cfg.mtp_num_layers} but the folder holds no multi-token "
          f"prediction layer (model.layers.{cfg.num_layers}.*): converted without it (model.mtp_num_layers=0)",
          file=sys.stderr)
    return dataclasses.replace(cfg, mtp_num_layers=0)


FINE_TUNE_SEQ_LENGTH = 4096  # the preset's sequence length when the model's context is longer (Llama 3.1: 131072)
SHAPE_KEYS = ("arch", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size")
NODE_GPUS = 8  # the preset's tensor-parallel size is picked for one node of this many 80 GB GPUs


def _node_tensor_size(cfg: Config) -> int:
    """The smallest tensor-parallel size (a power of 2 up to NODE_GPUS that divides the heads) whose fp32 weights
    and gradients (8 bytes a parameter over t) and ZeRO-1 optimizer state (8 bytes over the node) take at most 48 GB
    of an 80 GB GPU, leaving the rest to activations; NODE_GPUS when none does (the model needs a pipeline too)."""
    n, m = _parameters(cfg.model), cfg.model
    for t in (1, 2, 4, 8):
        if m.num_heads % t == 0 and m.kv_heads % t == 0 and m.ffn_size % t == 0 and (8 / t + 8 / NODE_GPUS) * n <= 48e9:
            return t
    return NODE_GPUS


def write_preset(cfg: Config, ckpt: Path, path: Path) -> None:
    """A complete fine-tuning preset for the converted model: bf16, a fine-tuning learning rate and schedule, a
    sequence length a GPU holds, its tokenizer, a layout for one node, and comments saying what to change."""
    m = cfg.model
    seq = min(m.seq_length, FINE_TUNE_SEQ_LENGTH)
    t = _node_tensor_size(cfg)
    name = ckpt.name.removesuffix("-megajax") or "model"
    defaults = ModelConfig().__dict__
    model = {k: v for k, v in cfg.to_dict()["model"].items() if k in SHAPE_KEYS or v != defaults[k]}
    model.update(seq_length=seq, compute_dtype="bfloat16", recompute="selective")
    sections = {
        "model": model,
        "parallel": {"tensor": t, "sequence_parallel": t > 1, "data_parallel_sharding_strategy": "optim"},
        "train": {"steps": 1000, "global_batch_size": 64, "micro_batch_size": 1, "log_every": 10, "eval_every": 200,
                  "output_dir": f"runs/{name}-finetune"},
        "optim": {"lr": 2.0e-5, "min_lr": 2.0e-6, "warmup_steps": 50, "decay": "cosine", "weight_decay": 0.1,
                  "clip_grad": 1.0},
        "data": {"paths": [], "tokenizer": cfg.data.tokenizer},
        "checkpoint": {"load_from": str(ckpt), "every": 200},
    }
    notes = {
        "model": [f"the converted architecture; seq_length {seq} (the model reads up to {m.seq_length}: raise it if "
                  "memory allows), bf16 compute over fp32 master weights, selective recompute, the fused "
                  "attention and norm kernels on GPUs (model.attention_impl and model.norm_impl auto)."],
        "parallel": [f"for one node of {NODE_GPUS} GPUs (parallel.data takes the rest): tensor {t} keeps the weights, "
                     "gradients and optimizer state under 48 GB of an 80 GB GPU. Check the layout before a run: "
                     f"python -m megajax.audit --config {path} --target h100 --devices {NODE_GPUS}"
                     + ("; this model needs a pipeline as well (parallel.pipeline)" if t == NODE_GPUS else "")],
        "train": ["global batch 64 sequences of seq_length tokens; steps: your data's tokens / (64 x seq_length) "
                  "per epoch"],
        "optim": ["a fine-tuning schedule: peak 2e-5, cosine to 2e-6 after 50 warm-up steps"],
        "data": ["paths: your data, preprocessed with this tokenizer (python -m megajax.data.preprocess); empty: "
                 "the bundled sample corpus"],
        "checkpoint": ["load_from: the converted weights (params only; the optimizer starts fresh)"],
    }
    lines = [f"# Fine-tune {m.arch} ({m.num_layers} layers, hidden {m.hidden_size}) converted from Hugging Face by "
             "megajax.convert; the weights are in",
             f"# {ckpt}. Train, then export back to Hugging Face:",
             f"#   python -m megajax.train --config {path}",
             f"#   python -m megajax.convert to-hf --checkpoint {sections['train']['output_dir']} --output "
             f"{name}-finetuned-hf"]
    if cfg.data.tokenizer == NO_TOKENIZER:
        lines.append("# data.tokenizer: no tokenizer.json came with the weights: set it to the model's tokenizer "
                     "folder before training")
    for section, values in sections.items():
        lines += ["", *(f"# {line}" for note in notes[section] for line in _wrap(note)),
                  yaml.safe_dump({section: values}, sort_keys=False).rstrip()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _wrap(text: str) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width=110)


def _side_dir(source: checkpoint.ParamsSource) -> Path | None:
    """The HF files kept at import: in the checkpoint itself, or in the one training started from."""
    for base in (source.root, source.config.checkpoint.load_from):
        if base and (Path(base) / HF_SUBDIR / "config.json").exists():
            return Path(base) / HF_SUBDIR
    return None


def _eos_id(cfg: Config) -> int | None:
    if cfg.data.tokenizer == NO_TOKENIZER:
        return None
    try:
        return get_tokenizer(cfg.data.tokenizer).eod
    except (ValueError, OSError):
        return None


def to_hf(checkpoint_dir: str | Path, output: str | Path, dtype: str | None = None,
          max_shard_size: str = "5GB", force: bool = False) -> list[str]:
    """Exports a megajax checkpoint (converted or training) as an HF folder; returns the files written."""
    source = checkpoint.find_params(checkpoint_dir)
    model_cfg = source.config.model
    checkpoint.check_params_fit(checkpoint.stored_shapes(source), _expected_shapes(model_cfg), str(source.root))
    params = checkpoint.load_params(source)
    tensors = hf.params_to_hf(model_cfg, params, dtype, where=str(source.root))
    dtype = dtype or str(next(iter(tensors.values())).dtype)
    side = _side_dir(source)
    base = json.loads((side / "config.json").read_text()) if side else None
    hf_cfg = hf.hf_config_from_model(model_cfg, dtype, base, eos_token_id=_eos_id(source.config))

    output = Path(output).absolute()
    _prepare_output(output, force)
    files = hf.write_safetensors(tensors, output, hf.parse_size(max_shard_size))
    (output / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    files.append("config.json")
    extra = [side / n for n in hf.SIDE_FILES] if side else []
    if Path(source.config.data.tokenizer).name == "tokenizer.json":
        extra.append(Path(source.config.data.tokenizer))
    for path in extra:
        if path.exists() and not (output / path.name).exists():
            shutil.copy2(path, output / path.name)
            files.append(path.name)
    return files


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megajax.convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("from-hf", help="HF folder (GPT-2, Llama, Mixtral, Qwen2, Qwen2-MoE, DeepSeek-V3) -> megajax "
                       "params checkpoint")
    a.add_argument("--model", required=True, help="local HF folder (config.json + *.safetensors)")
    a.add_argument("--output", required=True, help="checkpoint directory to create")
    a.add_argument("--config-out", help="also write a fine-tuning preset (YAML) that starts from the checkpoint and "
                   "trains as it is (bf16, fine-tuning schedule, a layout for one node)")
    a.add_argument("--force", action="store_true", help="replace an existing output checkpoint")
    b = sub.add_parser("to-hf", help="megajax checkpoint (converted or training) -> HF folder")
    b.add_argument("--checkpoint", required=True, help="converted checkpoint, training checkpoint dir or output dir")
    b.add_argument("--output", required=True, help="HF folder to create")
    b.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the stored dtype")
    b.add_argument("--max-shard-size", default="5GB", help="split model.safetensors above this (default 5GB)")
    b.add_argument("--force", action="store_true", help="replace an existing output folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    absl.logging.set_verbosity(absl.logging.ERROR)  # Orbax's notes on read-only directories are not news here
    t0 = time.perf_counter()
    try:
        if args.command == "from-hf":
            cfg = from_hf(args.model, args.output, args.config_out, args.force)
            m = cfg.model
            n = _parameters(m)
            print(f"wrote {args.output}: {m.arch}, {n / 1e6:.2f}M parameters ({m.num_layers} layers, "
                  f"d={m.hidden_size}, {m.num_heads} heads / {m.kv_heads} kv heads, vocab {m.vocab_size} padded to "
                  f"{m.padded_vocab_size}, {'tied' if m.tied else 'untied'}) in {time.perf_counter() - t0:.1f} s"
                  + (f"; preset {args.config_out}" if args.config_out else ""))
            if cfg.data.tokenizer == NO_TOKENIZER:
                print(f"note: no tokenizer.json beside the weights, so data.tokenizer={NO_TOKENIZER}: generate with "
                      "--prompt-ids or --tokenizer, and set data.tokenizer before training", file=sys.stderr)
        else:
            files = to_hf(args.checkpoint, args.output, args.dtype, args.max_shard_size, args.force)
            print(f"wrote {args.output}: {', '.join(files)} in {time.perf_counter() - t0:.1f} s")
    except (ConfigError, ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
