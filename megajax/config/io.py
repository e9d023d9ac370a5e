"""The configuration tree in and out: YAML presets, `--set a.b=c` overrides, and the `--help` list of every key.

megajax/config/__init__.py holds the tree and its checks; this module reads and writes it. A preset or an override
with an unknown key or a wrong type raises ConfigError naming the key (and the closest known one), before any check
of the tree runs. A renamed key (`OLD_KEYS`) still reads, as its new one, with a one-line notice naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from megajax.config import KEY_ALIASES, SPELLED, Config, ConfigError, section_fields
from megajax.config.base import check, concerns, short

log = logging.getLogger("megajax.config")

# Renamed keys: old key -> (the key that decides now, the old value as the new key's). Where both are set, the new
# key decides and the old one is not read (as before the rename).
OLD_KEYS = {
    "parallel.distributed_optimizer": ("parallel.data_parallel_sharding_strategy",
                                       lambda on: "optim" if on else "no_shard"),
}


def _renamed(old: str, value: Any, given: Any) -> Any:
    """The new key's value for an old key set to `value`, where the config gives the new key `given` (None: not
    given, or given as what the old key may change); a one-line notice either way."""
    new, convert = OLD_KEYS[old]
    value = _coerce(value, bool, old)
    if given is not None:
        log.warning(f"config: {old} is replaced by {new}, which is set ({given}) and decides; "
                    f"{old}={str(value).lower()} is not read: drop it")
        return given
    log.warning(f"config: {old}={str(value).lower()} is read as {new}={convert(value)}, the key that replaces it: "
                "set that one")
    return convert(value)


def _read_old_keys(data: dict, where: str) -> dict:
    """A section's mapping with its old keys (OLD_KEYS) read as their new ones."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for old in [k for k in OLD_KEYS if k.rpartition(".")[0] == where]:
        name = old.rpartition(".")[2]
        if name in data:
            new = OLD_KEYS[old][0].rpartition(".")[2]
            data[new] = _renamed(old, data.pop(name), data.get(new))
    return data


def _unknown_key(path: str, key: str, known: list[str], what: str) -> str:
    """'unknown config key 'parallel.tensr': did you mean 'parallel.tensor'? known keys here: ...'."""
    import difflib

    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    kind = "section" if what == "sections" else "key"
    if close and what != "sections":  # the suggestion; `--help` lists the rest
        return f"unknown config {kind} {path!r}: did you mean {path[: len(path) - len(key)] + close[0]!r}?"
    hint = f": did you mean {close[0]!r}?" if close else ""
    return f"unknown config {kind} {path!r}{hint} ({what}: {', '.join(known)})"


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Checks (and gently converts) `value` to the annotated type `tp`. (Each message is formatted only on a failure:
    a config is built for every layout a planner or a test enumerates.)"""
    origin, args = _parts(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {short(value)}")
    if origin is Literal:
        choices = args
        if value not in choices:
            raise ConfigError(f"{where}={short(value)} is not one of {', '.join(map(str, choices))}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {short(value)}")
        return list(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {short(value)}")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {short(value)}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {short(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {short(value)}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}")


@functools.lru_cache(maxsize=None)
def _parts(tp) -> tuple[Any, tuple]:
    """(typing.get_origin, typing.get_args) of an annotation."""
    return typing.get_origin(tp), typing.get_args(tp)


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'the config'} must be a mapping, got {short(data)}")
    data = _read_old_keys(data, where)
    section = section_fields(cls)
    hints, names = section.hints, section.names
    kwargs = {}
    for key, value in data.items():
        name = KEY_ALIASES.get(key, key)
        path = f"{where}.{key}" if where else key
        if name not in names:
            known = sorted({k for k, a in KEY_ALIASES.items() if a in names} | names - set(KEY_ALIASES.values()))
            raise ConfigError(_unknown_key(path, key, known, "sections" if not where else "keys here"))
        if name in section.sections:
            kwargs[name] = _build(hints[name], value, path)
        else:
            kwargs[name] = _coerce(value, hints[name], path)
    return cls(**kwargs)


def from_dict(data: dict) -> Config:
    """Builds a Config from a nested mapping; unknown keys and wrong types raise ConfigError."""
    return _build(Config, data or {}, "")


def parse_overrides(items: list[str]) -> dict:
    """['model.num_layers=4', 'data.paths=[0.3,a,0.7,b]'] -> {'model.num_layers': 4, ...} (values as YAML)."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        check(bool(sep) and bool(key), f"override {item!r} must look like section.key=value")
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None
    return out


def override(cfg: Config, flat: dict) -> Config:
    """Applies dotted-key overrides ({'model.num_layers': 4}) and re-validates everything."""
    data = cfg.to_dict()
    for key, value in flat.items():
        if key in OLD_KEYS:  # the new key, unless the overrides set it too or it holds more than the old one says
            new, convert = OLD_KEYS[key]
            section, _, name = new.partition(".")
            current = data[section][name]
            keep = new in flat or current not in {convert(True), convert(False)}
            key, value = new, _renamed(key, value, flat.get(new, current) if keep else None)
        parts = key.split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            if not isinstance(node.get(part), dict):
                known = sorted(k for k, v in node.items() if isinstance(v, dict))
                if not known:  # a value, not a section (model.num_layers.x)
                    raise ConfigError(f"config key {'.'.join(parts[: i + 1])!r} is a value, not a section: "
                                      f"override {key!r} names a key inside it")
                raise ConfigError(_unknown_key('.'.join(parts[: i + 1]), part, known,
                                               "sections" if i == 0 else "keys here"))
            node = node[part]
        if parts[-1] not in node:
            known = sorted(node)
            raise ConfigError(_unknown_key(key, parts[-1], known, "sections" if len(parts) == 1 else "keys here"))
        node[parts[-1]] = value
    return from_dict(data)


def load(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Loads a YAML preset (or the defaults) and applies `--set` style overrides."""
    data = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist (presets live in configs/)")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            what = " ".join(str(getattr(e, "problem", None) or e).split())[:200]
            raise ConfigError(f"config file {path} is not valid YAML{where}: {what}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path} cannot be read: {str(e)[:200]}") from None
    try:
        cfg = from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path is not None else str(e)) from None
    return override(cfg, parse_overrides(overrides or []))


def _field_comments(cls) -> dict[str, str]:
    """Field name -> its one line of meaning: the comment on the field's line, else the comment lines just above
    it (this file is where a key is described)."""
    import inspect
    import re

    out, above = {}, []
    for line in inspect.getsourcelines(cls)[0]:
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("# ").strip())
            continue
        m = re.match(r"(\w+): [^#]+?(?:#\s*(.*))?$", text) if line.startswith("    ") and not line.startswith(" " * 5) \
            else None
        if m and m.group(1) in {f.name for f in dataclasses.fields(cls)}:
            out[m.group(1)] = m.group(2) or " ".join(above)
        above = []
    return out


def keys_help() -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of every config key, as `--set` spells it."""
    rows = []
    for section in dataclasses.fields(Config):
        cls = type(section.default)
        comments = _field_comments(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            if kind.startswith("Literal["):  # (Literal[...] | None: the literal's values, then null)
                hint = section_fields(cls).hints[f.name]
                parts = [a for a in typing.get_args(hint) if a is not type(None)]
                literal = parts[0] if len(parts) == 1 and typing.get_origin(parts[0]) is typing.Literal else hint
                kind = "|".join(typing.get_args(literal)) + ("|null" if literal is not hint else "")
            meaning = comments.get(f.name, "")
            rows.append((f"{section.name}.{SPELLED.get(f.name, f.name)}", kind.replace("typing.", ""),
                         yaml.safe_dump(default, default_flow_style=True).removesuffix("\n...\n").strip(),
                         meaning))
    return rows


def concern_starts() -> dict[str, str]:
    """The key (as `keys_help` spells it) each concern of a section starts at -> the concern's title
    (megajax/config/base.py `concerns`): --help and docs/reference/config.md print the titles there."""
    return {f"{section.name}.{SPELLED.get(names[0], names[0])}": title
            for section in dataclasses.fields(Config)
            for title, names in concerns(type(section.default)) if title}


def add_cli_arguments(parser) -> None:
    """--config and --set (repeatable, each taking one or more KEY=VALUE), and every config key listed in the
    parser's --help (type, default, meaning), for the entry points that take a config."""
    import argparse

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--config", help="YAML preset (configs/*.yaml); without it, the defaults below")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override config keys, e.g. --set model.num_layers=4 parallel.tensor=2 (repeatable)")
    import textwrap

    lines, titles = [], concern_starts()
    for key, kind, default, meaning in keys_help():
        if key in titles:
            lines.append(f"  -- {key.split('.')[0]}: {titles[key]} --")
        lines.append(f"  {key}  ({kind}, default {default})")
        lines += textwrap.wrap(meaning, width=100, initial_indent="      ", subsequent_indent="      ")
    parser.epilog = "config keys (--set KEY=VALUE, or in the YAML preset):\n" + "\n".join(lines)
