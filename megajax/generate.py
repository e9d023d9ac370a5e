"""`python -m megajax.generate --checkpoint DIR --prompt "..."`: text generation with a KV cache.

    python -m megajax.generate --checkpoint runs/tiny --prompt "And God said" --max-new-tokens 200 \
        [--temperature 0.8 --top-k 40 --top-p 0.95 --seed 0 --num-samples 1] [--prompt-ids 1,2,3] [--json]

DIR is anything megajax.checkpoint.find_params accepts: a converted checkpoint (megajax.convert), a
training checkpoint directory (its newest step) or a train.output_dir. The tokenizer is the checkpoint
config's data.tokenizer unless --tokenizer names another. Two programs are compiled per (batch, prompt
length, new tokens, sampling settings): the prefill, which runs the prompt through the model and fills the
cache, and the decode loop, a lax.scan of one-token steps; nothing recompiles per token. Temperature 0 is
greedy decoding. Generation stops at the tokenizer's end-of-document id unless --ignore-eos.
"""

from __future__ import annotations

if __name__ == "__main__":  # pick the platform before JAX is imported (it reads JAX_PLATFORMS at import)
    from megajax.distributed import prefer_cpu_without_gpu

    prefer_cpu_without_gpu()

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import absl.logging
import jax
import jax.numpy as jnp
import numpy as np

from megajax import checkpoint, model
from megajax.config import ConfigError, ModelConfig


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is picked from the logits. temperature=0: greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (1 disables it), got {self.top_p}")


def sample_next(logits_bv: jax.Array, key: jax.Array, sampling: Sampling, vocab_size: int) -> jax.Array:
    """Next token ids [b] from fp32 logits [b, v_padded]; padded vocabulary entries are never picked."""
    ids = jax.lax.broadcasted_iota(jnp.int32, logits_bv.shape, 1)
    logits = jnp.where(ids < vocab_size, logits_bv, -jnp.inf)
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = jax.lax.top_k(logits, min(sampling.top_k, vocab_size))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        # Keep the smallest set of most likely tokens whose probability reaches top_p: a token stays if
        # the probability of the tokens ranked above it is still below top_p (so the first always stays).
        desc = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(desc, axis=-1)
        above = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(above < sampling.top_p, desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _programs(cfg: ModelConfig, batch: int, prompt_len: int, new_tokens: int, sampling: Sampling):
    """The prefill and decode-loop functions for one shape (jitted by the caller)."""
    max_len = prompt_len + new_tokens

    def prefill(params, prompt_bs, key):
        state = model.init_decode_state(cfg, batch, max_len)
        logits, state = model.decode_apply(cfg, params, prompt_bs, state)
        return sample_next(logits, key, sampling, cfg.vocab_size), state

    def decode(params, first_b, state, keys):
        def step(carry, key):
            token, state = carry
            logits, state = model.decode_apply(cfg, params, token[:, None], state)
            return (sample_next(logits, key, sampling, cfg.vocab_size), state), token

        (last, _), fed = jax.lax.scan(step, (first_b, state), keys)  # fed: [n - 1, b], the tokens fed back
        return jnp.concatenate([fed.T, last[:, None]], axis=1)

    return prefill, decode


@functools.lru_cache(maxsize=8)
def compiled(cfg: ModelConfig, batch: int, prompt_len: int, new_tokens: int, sampling: Sampling,
             params_shapes) -> tuple:
    """(prefill, decode) compiled once per shape; params_shapes: a hashable description of the params."""
    prefill, decode = _programs(cfg, batch, prompt_len, new_tokens, sampling)
    params = jax.tree.unflatten(params_shapes[0], params_shapes[1])
    prompt = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    prefill_c = jax.jit(prefill).lower(params, prompt, key).compile()
    first, state = jax.eval_shape(prefill, params, prompt, key)
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), new_tokens - 1))
    decode_c = jax.jit(decode).lower(params, first, state, keys).compile()
    return prefill_c, decode_c


@dataclasses.dataclass(frozen=True)
class Generation:
    tokens: np.ndarray  # [b, n] generated ids (not truncated at end of document)
    prefill_s: float  # the prompt through the model and the first token sampled
    decode_s: float  # the remaining n - 1 tokens
    compile_s: float  # 0 when the programs were already compiled

    @property
    def tokens_per_s(self) -> float | None:
        """Decode throughput: tokens sampled per second after the first, over the batch (None for one token)."""
        b, n = self.tokens.shape
        return b * (n - 1) / self.decode_s if n > 1 and self.decode_s > 0 else None

    @property
    def total_tokens_per_s(self) -> float:
        """All new tokens over prefill plus decode time (compile excluded)."""
        return self.tokens.size / (self.prefill_s + self.decode_s)


def generate(cfg: ModelConfig, params, prompt_bs: np.ndarray, max_new_tokens: int,
             sampling: Sampling = Sampling(), seed: int = 0) -> Generation:
    """Samples max_new_tokens after each prompt row ([b, p] ids, all the same length) with a KV cache."""
    prompt = jnp.asarray(prompt_bs, jnp.int32)
    b, p = prompt.shape
    if p < 1 or max_new_tokens < 1:
        raise ValueError(f"need a prompt of at least one token and max_new_tokens >= 1, got {p} and {max_new_tokens}")
    if cfg.arch == "gpt2" and p + max_new_tokens - 1 > cfg.seq_length:
        raise ValueError(f"the prompt ({p} tokens) plus {max_new_tokens} new tokens needs {p + max_new_tokens - 1} "
                         f"positions, but GPT-2's learned position embedding has model.seq_length={cfg.seq_length}: "
                         "shorten the prompt or lower --max-new-tokens")
    leaves, tree = jax.tree.flatten(params)
    shapes = (tree, tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves))
    t0 = time.perf_counter()
    hit = compiled.cache_info().hits
    prefill_c, decode_c = compiled(cfg, b, p, max_new_tokens, sampling, shapes)
    compile_s = 0.0 if compiled.cache_info().hits > hit else time.perf_counter() - t0
    key_first, key_rest = jax.random.split(jax.random.key(seed))
    keys = jax.random.split(key_rest, max_new_tokens - 1)
    t0 = time.perf_counter()
    first, state = prefill_c(params, prompt, key_first)
    first.block_until_ready()
    t1 = time.perf_counter()
    tokens = np.asarray(decode_c(params, first, state, keys))
    t2 = time.perf_counter()
    return Generation(tokens, t1 - t0, t2 - t1, compile_s)


def load(checkpoint_dir: str | Path, compute_dtype: str | None = None):
    """(config, params on one device) from any checkpoint megajax.checkpoint.find_params accepts."""
    source = checkpoint.find_params(checkpoint_dir)
    cfg = source.config
    if compute_dtype:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compute_dtype=compute_dtype))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = model.abstract_params(cfg.model)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
    return cfg, checkpoint.load_params(source, target)


def _tokenizer(name: str):
    from megajax.data.tokenizers import get_tokenizer

    try:
        return get_tokenizer(name)
    except (ValueError, OSError, ImportError) as e:
        return e


def _parse_ids(text: str, vocab_size: int) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r} must be comma-separated integers, like 1,2,3") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"--prompt-ids {bad} are outside the vocabulary [0, {vocab_size})")
    return ids


def _prompt_ids(args, tokenizer, vocab_size: int) -> list[int]:
    if args.prompt_ids is not None:
        return _parse_ids(args.prompt_ids, vocab_size)
    if isinstance(tokenizer, Exception):
        raise ValueError(f"cannot tokenize --prompt: {tokenizer} (pass --tokenizer or --prompt-ids)")
    # An empty prompt starts a new document: the end-of-document id is what precedes every document.
    return tokenizer.encode(args.prompt) or [tokenizer.eod]


def _cut_at_eos(ids: list[int], eos: int | None) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos is not None and eos in ids else ids


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megajax.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="converted or training checkpoint (or train.output_dir)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text to continue")
    prompt.add_argument("--prompt-ids", help="token ids to continue, comma-separated: 1,2,3")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-samples", type=int, default=1, help="continuations of the prompt, as one batch")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-document id")
    parser.add_argument("--tokenizer", help="override the checkpoint config's data.tokenizer")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype (default: the config's)")
    parser.add_argument("--json", action="store_true", help="print ids, text and timings as JSON")
    return parser


def run(args: argparse.Namespace) -> dict:
    """Loads, tokenizes, generates; returns the JSON-able result."""
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    cfg, params = load(args.checkpoint, args.dtype)
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    tokenizer = _tokenizer(args.tokenizer or cfg.data.tokenizer)
    ids = _prompt_ids(args, tokenizer, cfg.model.vocab_size)
    prompt = np.tile(np.asarray(ids, np.int32)[None], (args.num_samples, 1))
    out = generate(cfg.model, params, prompt, args.max_new_tokens, sampling, args.seed)
    has_tok = not isinstance(tokenizer, Exception)
    eos = None if args.ignore_eos or not has_tok else tokenizer.eod
    samples = []
    for row in out.tokens.tolist():
        row = _cut_at_eos(row, eos)
        samples.append({"ids": row, "text": tokenizer.decode(row) if has_tok else None})
    return {"prompt_ids": ids, "prompt": tokenizer.decode(ids) if has_tok else None, "ids": samples[0]["ids"],
            "text": samples[0]["text"], "samples": samples, "new_tokens": int(out.tokens.size),
            "tokens_per_s": out.tokens_per_s, "total_tokens_per_s": out.total_tokens_per_s,
            "prefill_s": out.prefill_s, "decode_s": out.decode_s, "compile_s": out.compile_s,
            "device": str(jax.devices()[0].device_kind)}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    absl.logging.set_verbosity(absl.logging.ERROR)  # Orbax's notes on read-only directories are not news here
    try:
        result = run(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
        return 0
    for i, s in enumerate(result["samples"]):
        if len(result["samples"]) > 1:
            print(f"--- sample {i + 1}")
        if s["text"] is None:
            print(f"{result['prompt_ids']} + {s['ids']}")
        else:
            print((result["prompt"] or "") + s["text"])
    rate = result["tokens_per_s"]
    print(f"[{result['new_tokens']} tokens: {'n/a' if rate is None else f'{rate:.1f}'} tokens/s decoding "
          f"({result['total_tokens_per_s']:.1f} with the prefill of {len(result['prompt_ids'])} tokens, "
          f"{1e3 * result['prefill_s']:.1f} ms); compile {result['compile_s']:.1f} s; {result['device']}]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
