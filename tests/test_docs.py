"""The README and the documentation site: the site builds strictly (no broken link or anchor, no page missing
from the nav), the generated config reference is current, the README stays short, and every command shown in a
```bash block of README.md or docs/ names files, flags, config keys and extras that exist.

Commands are checked, not run (the cheap ones, such as the tiny preset's training and the audit, run in
tests/test_train_e2e.py and tests/test_audit.py): each `python -m megajax.X` / `megajax X` flag against that
command's own argument parser, each `--config` file under configs/, each `--set` (and sbatch) override against the
configuration tree, loaded on top of its preset, each script path, each pip extra against pyproject.toml.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest

from conftest import REPO, cli_env
from megajax import config as config_lib
from megajax.config import io as config_io

ROOT = Path(REPO)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MODULES = {"train": "megajax.train", "audit": "megajax.audit", "generate": "megajax.generate",
           "convert": "megajax.convert", "checkpoint": "megajax.checkpoint", "preprocess": "megajax.data.preprocess",
           "schedule": "megajax.parallel.pipeline.schedule_cli", "plan": "megajax.plan"}
SEPARATORS = {"&&", "||", ";", "|"}


def test_docs_site_builds_strictly(tmp_path):
    """`mkdocs build --strict` (the `docs` extra): a broken link or anchor, or a page left out of the nav, fails."""
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


def test_config_reference_is_current():
    """docs/reference/config.md is what scripts/config_reference.py writes from megajax/config/__init__.py."""
    run = subprocess.run([sys.executable, "scripts/config_reference.py", "--check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=cli_env())
    assert run.returncode == 0, run.stderr


def test_readme_is_a_short_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for history in ("this stop", "half an hour before", "moved to -m slow", "measured earlier", "min 4 s"):
        assert history not in text
    assert "pip install -e '.[test,gpu-audit,docs]' && python -m pytest -q" in text  # .ci/run's command
    ci = (ROOT / ".ci" / "run").read_text()
    assert "'.[test,gpu-audit,docs]'" in ci and "python -m pytest -q" in ci


def _blocks(path: Path) -> list[str]:
    return re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", path.read_text(), re.M | re.S)


def _commands(block: str) -> list[list[str]]:
    """Each command of a bash block as tokens: continuation lines joined, comments dropped, split at && ; |."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split, lexer.commenters = True, "#"
        command = []
        for token in list(lexer) + [";"]:
            if token in SEPARATORS:
                if command:
                    out.append(command)
                command = []
            else:
                command.append(token)
    return out


def _preset_block(path: Path) -> str:
    """The commands in a preset's header comment (lines "#   command", continued with a backslash)."""
    lines = [line[4:] for line in path.read_text().splitlines() if line.startswith("#   ")]
    return "\n".join(lines) + "\n"


def _all_commands() -> list[tuple[str, list[str]]]:
    blocks = [(path, block) for path in PAGES for block in _blocks(path)]
    blocks += [(path, _preset_block(path)) for path in sorted((ROOT / "configs").glob("*.yaml"))]
    return [(f"{path.relative_to(ROOT)}: {' '.join(cmd)}", cmd) for path, block in blocks for cmd in _commands(block)]


@cache
def _help(module: str, sub: str | None) -> str:
    """The --help text of `python -m module [sub]`, from its own argument parser (in this process)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        mod = importlib.import_module(module)
        if hasattr(mod, "__path__"):  # a package: `python -m` runs its __main__
            mod = importlib.import_module(module + ".__main__")
        mod.main([sub, "--help"] if sub else ["--help"])
    return out.getvalue()


def _check_overrides(config: str | None, sets: list[str], where: str) -> None:
    """The overrides on top of their preset; with a preset the command itself writes (convert's), the keys."""
    preset = ROOT / config if config else None
    if config is None or preset.exists():
        config_io.load(preset, sets)  # unknown keys, wrong types and impossible layouts raise ConfigError
        return
    assert not config.startswith("configs/"), f"{where}: {config} does not exist"
    known = {key for key, *_ in config_io.keys_help()}
    for key in config_io.parse_overrides(sets):
        assert key in known, f"{where}: unknown config key {key}"


def _check_megajax(module: str, args: list[str], where: str) -> None:
    sub = args[0] if module == "megajax.convert" and args and not args[0].startswith("-") else None
    text = _help(module, sub)
    flags = [a.split("=")[0] for a in args if re.fullmatch(r"--?[a-zA-Z][\w-]*(=.*)?", a)]
    for flag in flags:
        assert re.search(rf"(^|[\s\[,]){re.escape(flag)}\b", text, re.M), f"{where}: {module} has no flag {flag}"
    config = args[args.index("--config") + 1] if "--config" in args else None
    if module == "megajax.train" or "--set" in args:
        sets = []
        if "--set" in args:
            for arg in args[args.index("--set") + 1:]:
                if arg.startswith("--"):
                    break
                sets.append(arg)
        _check_overrides(config, sets, where)
    elif config and config.startswith("configs/"):
        assert (ROOT / config).exists(), f"{where}: {config} does not exist"


def _check(cmd: list[str], where: str) -> None:
    while cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", cmd[0]):  # XLA_FLAGS=... python ...
        cmd = cmd[1:]
    if not cmd:
        return
    head, args = cmd[0], cmd[1:]
    if head in ("python", "python3") and args[:1] == ["-m"]:
        module, args = args[1], args[2:]
        if module == "megajax":
            if args[0] in ("-h", "--help"):
                return
            module, args = MODULES[args[0]], args[1:]
        if module.startswith("megajax"):
            _check_megajax(module, args, where)
        elif module == "pytest":
            paths = [a for i, a in enumerate(args) if not a.startswith("-") and args[i - 1] not in ("-m", "-k", "-n")]
            assert all((ROOT / a.split("::")[0]).exists() for a in paths), f"{where}: no test file {paths}"
    elif head in ("python", "python3") and args and args[0].endswith(".py"):
        assert (ROOT / args[0]).exists(), f"{where}: no {args[0]}"
    elif head == "megajax":
        if args[0] in ("-h", "--help"):
            return
        assert args[0] in MODULES, f"{where}: megajax has no command {args[0]}"
        _check_megajax(MODULES[args[0]], args[1:], where)
    elif head in ("bash", "sh") or head.startswith("scripts/") or head.startswith("./scripts/"):
        script = args[0] if head in ("bash", "sh") else head
        assert (ROOT / script).exists(), f"{where}: no {script}"
        if "--" in cmd:
            _check(cmd[cmd.index("--") + 1:], where)
    elif head == "sbatch":
        script = next(a for a in args if a.startswith("scripts/"))
        assert (ROOT / script).exists(), f"{where}: no {script}"
        rest = args[args.index(script) + 1:]
        if rest:
            _check_overrides(rest[0], [a for a in rest[1:] if "=" in a], where)
    elif head == "pip" and "-e" in args:
        extras = re.search(r"\[(.*)\]", args[args.index("-e") + 1])
        declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for extra in extras.group(1).split(",") if extras else []:
            assert extra in declared, f"{where}: no extra {extra!r} in pyproject.toml"


def test_every_documented_command_names_real_files_flags_and_keys():
    commands = _all_commands()
    assert len(commands) > 40, "the commands of README and docs were not found"
    failures = []
    for where, cmd in commands:
        try:
            _check(cmd, where)
        except (AssertionError, config_lib.ConfigError, KeyError, StopIteration) as e:
            failures.append(f"{where}\n    {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)


def test_the_checker_catches_a_typo():
    """The command check is not vacuous: a mistyped flag, key, preset or extra fails it."""
    for bad in ("python -m megajax.train --config configs/tiny.yaml --set parallel.tensr=2",
                "python -m megajax.audit --config configs/tiny.yaml --devices 8 --target-gpu h100",
                "python -m megajax.train --config configs/no-such.yaml",
                "sbatch --nodes=2 scripts/slurm.sbatch configs/tiny.yaml model.num_layer=4",
                "pip install -e '.[gpus]'", "python -m pytest -q -m slow tests/test_nothing.py"):
        with pytest.raises((AssertionError, config_lib.ConfigError)):
            for cmd in _commands(bad):
                _check(cmd, bad)
