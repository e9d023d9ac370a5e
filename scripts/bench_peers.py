"""megajax's train step beside a PyTorch peer of the same shape, timed in one run on the same GPU.

    python scripts/bench_peers.py --config configs/gpt2-124m.yaml --set train.global_batch_size=32 \
        --steps 10 --label gpt2-124m --jsonl peers.jsonl

The peer is the model PyTorch users train at that shape: nanoGPT's GPT (written out here, as nanoGPT's model.py
has it) for model.arch=gpt2, Hugging Face's LlamaForCausalLM for llama. Both sides take the same batch of random
tokens a step (global batch x sequence), in the same micro batches, with bf16 autocast over fp32 weights (or
fp32 where megajax computes in fp32), SDPA attention, fused AdamW, torch.compile on the peer. The peer recomputes
nothing (its fastest form); megajax runs the config as given. Each side runs in its own process, one after the
other (JAX takes most of the GPU's memory for itself), and the parameter counts must agree.

Prints one JSON row per side and a summary row with megajax's speed over the peer's (above 1: megajax faster).
`--device cpu --no-compile` runs the whole thing on a CPU at tiny shapes (the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

import bench_train  # noqa: E402 - megajax's timed step and the benchmarks' JSONL rows


def shape(cfg) -> dict:
    """The shape both sides train: the model, and the tokens of a step in its micro batches."""
    m = cfg.model
    return {"arch": m.arch, "layers": m.num_layers, "hidden": m.hidden_size, "heads": m.num_heads,
            "kv_heads": m.kv_heads, "ffn": m.ffn_size, "vocab": m.padded_vocab_size, "seq": m.seq_length,
            "tied": m.tied, "rope_theta": m.rope_theta, "eps": m.norm_eps,
            "micro_batch": cfg.train.micro_batch_size * cfg.parallel.data, "micro_batches": cfg.num_micro_batches,
            "bf16": m.compute_dtype == "bfloat16"}


# ---------------------------------------------------------------------------------------------------------
# The peers (torch is imported only in the peer's process)


def nanogpt(s: dict):
    """nanoGPT's GPT (karpathy/nanoGPT model.py, no dropout): LayerNorm with bias, fused QKV, SDPA, GELU, tied."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    d, h = s["hidden"], s["heads"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.c_fc, self.mlp_proj = nn.Linear(d, s["ffn"]), nn.Linear(s["ffn"], d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
            q, k, v = (a.view(b, t, h, d // h).transpose(1, 2) for a in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.c_proj(y)
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(s["vocab"], d), nn.Embedding(s["seq"], d)
            self.blocks = nn.ModuleList(Block() for _ in range(s["layers"]))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, s["vocab"], bias=False)
            self.lm_head.weight = self.wte.weight  # tied, as nanoGPT's

        def forward(self, tokens, targets):
            x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
            for block in self.blocks:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    return GPT()


def hf_llama(s: dict):
    """Hugging Face's LlamaForCausalLM with SDPA attention."""
    import torch.nn.functional as F
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                         num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                         num_key_value_heads=s["kv_heads"], max_position_embeddings=s["seq"],
                         rms_norm_eps=s["eps"], rope_theta=s["rope_theta"], tie_word_embeddings=s["tied"],
                         attn_implementation="sdpa", use_cache=False)

    class Peer(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = LlamaForCausalLM(config)

        def forward(self, tokens, targets):
            logits = self.model(input_ids=tokens).logits
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    return Peer()


PEERS = {"gpt2": ("nanoGPT", nanogpt), "llama": ("Hugging Face LlamaForCausalLM", hf_llama)}


def time_peer(s: dict, steps: int, warmup: int, device: str, compile_: bool) -> dict:
    """The peer's step (its micro batches accumulated, then fused AdamW), timed over `steps` after `warmup`."""
    import torch

    name, build = PEERS[s["arch"]]
    torch.manual_seed(0)
    model = build(s).to(device)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device != "cpu")
    step_model = torch.compile(model) if compile_ else model
    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, s["vocab"], (s["micro_batches"], s["micro_batch"], s["seq"] + 1), generator=gen)
    tokens = tokens.to(device)
    autocast = torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=s["bf16"])

    def step():
        for mb in tokens:
            with autocast:
                loss = step_model(mb[:, :-1], mb[:, 1:]) / s["micro_batches"]
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    dt = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
    return {"side": "peer", "peer": name, "torch": torch.__version__, "compiled": compile_, "params": params,
            "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "warmup_s": compile_s, "step_s": dt, "loss": float(loss) * s["micro_batches"], "peak_bytes": peak}


def time_megajax(cfg, steps: int, warmup: int) -> dict:
    import jax

    return {"side": "megajax", **bench_train.bench(cfg, steps, warmup, jax.devices()[:1])}  # the peer's one GPU


# ---------------------------------------------------------------------------------------------------------


def _side(args) -> dict:
    """One side, in this process."""
    from megajax import distributed
    from megajax.config import io as config_io

    if args.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    distributed.prefer_cpu_without_gpu()
    cfg = config_io.load(args.config, args.set).for_devices(1)
    if args.side == "megajax":
        return time_megajax(cfg, args.steps, args.warmup)
    return time_peer(shape(cfg), args.steps, args.warmup, args.device, not args.no_compile)


def _run_side(side: str, argv: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "scripts")])}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--side", side], env=env,
                         capture_output=True, text=True)
    rows = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not rows:
        raise SystemExit(f"the {side} side failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(rows[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML preset (configs/*.yaml)")
    parser.add_argument("--set", nargs="*", default=[], action="extend", metavar="KEY=VALUE",
                        help="config overrides, as for python -m megajax.train")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation included)")
    parser.add_argument("--label", default="", help="a name for this row")
    parser.add_argument("--jsonl", help="append the rows to this file")
    parser.add_argument("--device", default="cuda", help="the peer's torch device (cuda, or cpu for a test)")
    parser.add_argument("--no-compile", action="store_true", help="the peer eager (torch.compile off)")
    parser.add_argument("--side", choices=["megajax", "peer"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:  # a child process: one side, one JSON line
        print(json.dumps(_side(args)))
        return 0
    common = [a for a in argv if a not in ("--jsonl", args.jsonl)]
    ours, peer = _run_side("megajax", common), _run_side("peer", common)
    if abs(ours["params"] - peer["params"]) > 1e-3 * peer["params"]:
        raise SystemExit(f"not the same shape: megajax has {ours['params']:,} parameters, the peer "
                         f"{peer['params']:,}")
    summary = {"label": args.label, "config": args.config, "set": args.set, "peer": peer["peer"],
               "megajax_step_s": ours["step_s"], "peer_step_s": peer["step_s"],
               "speedup": peer["step_s"] / ours["step_s"], "megajax_mfu": ours["mfu"],
               "peer_mfu": ours["mfu"] * ours["step_s"] / peer["step_s"],  # the same model FLOPs a step
               "device": ours.get("device"), "date": time.strftime("%Y-%m-%d")}
    rows = [{"label": args.label, **ours}, {"label": args.label, **peer}, {"summary": True, **summary}]
    for row in rows:
        print(json.dumps(row))
        bench_train.append_row(args.jsonl, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
