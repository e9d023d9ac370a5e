"""python -m megajax.checkpoint inspect DIR | export DIR OUT (megajax/checkpoint/__init__.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from megajax import config as config_lib
from megajax.checkpoint import __doc__ as DOC
from megajax.checkpoint.params import find_params, load_params, save_params
from megajax.checkpoint.training import inspect


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megajax.checkpoint", description=DOC.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("inspect", help="list steps and array shapes, dtypes and sizes")
    ins.add_argument("dir")
    exp = sub.add_parser("export", help="write the params only (canonical layout) with their config.yaml")
    exp.add_argument("dir", help="a training checkpoint directory, one of its steps, or a train.output_dir")
    exp.add_argument("out")
    args = parser.parse_args(argv)
    from megajax.distributed import prefer_cpu_without_gpu

    prefer_cpu_without_gpu()
    try:
        if args.cmd == "inspect":
            print(json.dumps(inspect(args.dir), indent=2))
        else:
            source = find_params(args.dir)
            save_params(args.out, load_params(source), source.config)
            print(f"exported the params of {source.tree} to {os.path.abspath(args.out)}")
    except config_lib.InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
