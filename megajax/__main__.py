"""`megajax COMMAND [ARGS]` (or `python -m megajax COMMAND [ARGS]`): runs `python -m megajax.<module> [ARGS]`.

With no command, or --help, it lists the commands; `megajax COMMAND --help` explains each one's arguments.
"""

from __future__ import annotations

import runpy
import sys

COMMANDS = {
    "train": ("megajax.train", "train a model (the main job); --help lists every config key"),
    "plan": ("megajax.plan", "the layout for a model on N GPUs: predicted step time, memory and why, from a cost model and the compiled program"),
    "audit": ("megajax.audit", "memory, FLOPs and collectives of a layout's compiled step, for CPU or GPU targets"),
    "generate": ("megajax.generate", "generate text from a checkpoint"),
    "convert": ("megajax.convert", "Hugging Face weights (GPT-2, Llama, Mixtral, Qwen2, Qwen2-MoE, DeepSeek-V3) to and from megajax checkpoints"),
    "checkpoint": ("megajax.checkpoint", "a checkpoint: inspect DIR (steps, arrays) or export DIR OUT (parameters)"),
    "preprocess": ("megajax.data.preprocess", "tokenize a corpus into Megatron's .bin/.idx format"),
    "schedule": ("megajax.parallel.pipeline.schedule_cli", "print, check or draw a pipeline schedule"),
    "goodput": ("megajax.goodput", "where a run's wall time went, over all its restarts (RUN_DIR)"),
    "watchdog": ("megajax.watchdog", "which process of a job is behind, from its heartbeats (PROGRESS_DIR)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "usage: megajax COMMAND [ARGS]   (python -m megajax COMMAND [ARGS])\n\ncommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"error: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv = [f"megajax {argv[0]}", *argv[1:]]
    try:
        runpy.run_module(COMMANDS[argv[0]][0], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
