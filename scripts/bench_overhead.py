"""megajax's framework overhead: `python -m megajax.train` against the same model written as plain JAX.

    python scripts/bench_overhead.py [--rounds 5] [--steps 60] [--json out.json]

The model: GPT-2 (learned positions, pre-LayerNorm, GELU MLP of 4x, tied embeddings), 4 layers of 256, 4 heads,
sequence 256, batch 8, vocabulary 8192, fp32, AdamW (warm-up and cosine decay, clipping at 1.0), on the devices
at hand (one CPU device unless XLA_FLAGS says otherwise). megajax trains it on the bundled corpus with its
defaults (no recomputation, no dropout); the plain program is a scan over the layers, optax's AdamW and one jit,
fed random tokens put on the device each step. Both run as fresh processes, alternating (megajax, plain) for
--rounds rounds; each reports its tokens/s over the steps after the first --warmup (the compile and the first
steps excluded), and the ratio is the median of megajax's over the median of plain's. Run it on an idle
machine: both programs share the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

LAYERS, WIDTH, HEADS, SEQ, BATCH, VOCAB = 4, 256, 4, 256, 8, 8192


def megajax_command(steps: int, log_every: int, out: str) -> list[str]:
    sets = ["model.arch=gpt2", f"model.num_layers={LAYERS}", f"model.hidden_size={WIDTH}",
            f"model.num_heads={HEADS}", f"model.seq_length={SEQ}", f"model.vocab_size={VOCAB}",
            "model.compute_dtype=float32", "model.param_dtype=float32", "model.recompute=none",
            f"train.steps={steps}", f"train.global_batch_size={BATCH}", f"train.log_every={log_every}",
            "train.eval_every=0", "checkpoint.every=0", f"train.output_dir={out}"]
    return [sys.executable, "-m", "megajax.train", "--set", *sets]


def megajax_rate(steps: int, warmup: int, log_every: int) -> float:
    """tokens/s of `python -m megajax.train` over the log intervals after `warmup` steps (from metrics.jsonl)."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(megajax_command(steps, log_every, out), check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > warmup]
    return BATCH * SEQ / statistics.mean(times)


def plain_rate(steps: int, warmup: int) -> float:
    """tokens/s of the plain JAX program (this file with --plain, in a fresh process)."""
    out = subprocess.run([sys.executable, __file__, "--plain", "--steps", str(steps), "--warmup", str(warmup)],
                         check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------
# The plain program


def plain_main(steps: int, warmup: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    d, h, k = WIDTH, HEADS, WIDTH // HEADS

    def init(key):
        ks = jax.random.split(key, 6)
        normal = lambda key, shape, std=0.02: std * jax.random.normal(key, shape, jnp.float32)  # noqa: E731
        out_std = 0.02 / (2 * LAYERS) ** 0.5
        layers = {
            "ln1": jnp.ones((LAYERS, d)), "ln1_b": jnp.zeros((LAYERS, d)),
            "qkv": normal(ks[0], (LAYERS, d, 3 * d)), "qkv_b": jnp.zeros((LAYERS, 3 * d)),
            "proj": normal(ks[1], (LAYERS, d, d), out_std), "proj_b": jnp.zeros((LAYERS, d)),
            "ln2": jnp.ones((LAYERS, d)), "ln2_b": jnp.zeros((LAYERS, d)),
            "fc": normal(ks[2], (LAYERS, d, 4 * d)), "fc_b": jnp.zeros((LAYERS, 4 * d)),
            "out": normal(ks[3], (LAYERS, 4 * d, d), out_std), "out_b": jnp.zeros((LAYERS, d)),
        }
        return {"wte": normal(ks[4], (VOCAB, d)), "wpe": normal(ks[5], (SEQ, d)), "layers": layers,
                "ln_f": jnp.ones((d,)), "ln_f_b": jnp.zeros((d,))}

    def norm(x, scale, bias):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias

    def block(x, w):
        b, s, _ = x.shape
        qkv = norm(x, w["ln1"], w["ln1_b"]) @ w["qkv"] + w["qkv_b"]
        q, kk, v = (a.reshape(b, s, h, k) for a in jnp.split(qkv, 3, axis=-1))
        logits = jnp.einsum("bqhk,bshk->bhqs", q, kk) / k ** 0.5
        logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -1e30)
        a = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(logits, -1), v).reshape(b, s, d)
        x = x + a @ w["proj"] + w["proj_b"]
        m = jax.nn.gelu(norm(x, w["ln2"], w["ln2_b"]) @ w["fc"] + w["fc_b"], approximate=True)
        return x + m @ w["out"] + w["out_b"], None

    def loss_fn(params, tokens, targets):
        x = params["wte"][tokens] + params["wpe"][None]
        x, _ = jax.lax.scan(block, x, params["layers"])
        logits = norm(x, params["ln_f"], params["ln_f_b"]) @ params["wte"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, a: a.ndim - (path[0].key == "layers") >= 2, params)

    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-4, 10, steps, 3e-5)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=decay_mask))

    @jax.jit
    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = init(jax.random.key(0))
    opt_state = tx.init(params)
    rng = np.random.default_rng(0)
    start = None
    for i in range(steps):
        if i == warmup:
            jax.block_until_ready(params)
            start = time.perf_counter()
        data = rng.integers(0, VOCAB, (BATCH, SEQ + 1), dtype=np.int32)
        params, opt_state, loss = step(params, opt_state, jnp.asarray(data[:, :-1]), jnp.asarray(data[:, 1:]))
    jax.block_until_ready(params)
    print(BATCH * SEQ * (steps - warmup) / (time.perf_counter() - start))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="(megajax, plain) pairs, alternating")
    parser.add_argument("--steps", type=int, default=60, help="steps each run trains")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the rate (compile included)")
    parser.add_argument("--json", help="also write the rates and the ratio to this file")
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)  # one plain run (internal)
    args = parser.parse_args(argv)
    if args.plain:
        plain_main(args.steps, args.warmup)
        return 0
    if args.steps <= args.warmup or args.warmup % 10:
        parser.error("--warmup must be a multiple of 10 (megajax logs every 10 steps) and below --steps")
    ours, plain = [], []
    for r in range(args.rounds):
        ours.append(megajax_rate(args.steps, args.warmup, 10))
        plain.append(plain_rate(args.steps, args.warmup))
        print(f"round {r + 1}: megajax {ours[-1]:.0f} tok/s, plain JAX {plain[-1]:.0f} tok/s, "
              f"ratio {ours[-1] / plain[-1]:.3f}", flush=True)
    ratio = statistics.median(ours) / statistics.median(plain)
    print(f"median: megajax {statistics.median(ours):.0f} tok/s, plain JAX {statistics.median(plain):.0f} tok/s, "
          f"ratio {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"megajax_tokens_per_s": ours, "plain_tokens_per_s": plain, "ratio_of_medians": ratio,
                       "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
                       "model": {"layers": LAYERS, "width": WIDTH, "heads": HEADS, "seq": SEQ, "batch": BATCH,
                                 "vocab": VOCAB}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
