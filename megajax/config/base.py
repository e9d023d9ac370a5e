"""What every config section is built from: the errors that name the fix, the check that raises one, and the
field helpers whose metadata say whether a key may change when a run resumes and whether it defines the model
(read by megajax.config.may_change_on_resume and model_defining_fields). Public within megajax.config: every
section module and io.py build on them."""

from __future__ import annotations

import dataclasses
from typing import Any


class InputError(ValueError):
    """Bad input from the user (a config, a layout, a data file, a checkpoint, a flag) whose message names
    the fix. Entry points print it as one line and exit 2; any other exception is a bug and keeps its
    traceback."""


class ConfigError(InputError):
    """A configuration that cannot run; the message says what to change."""


def short(value: Any) -> str:
    """A bounded repr for messages: a preset's hostile or huge value (YAML aliases nested many levels deep expand
    to gigabytes) must not be printed whole."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxdict, r.maxstring, r.maxother = 2, 4, 4, 60, 60
    return r.repr(value)


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# Field metadata keys.
RESUME = "may_change_on_resume"
MODEL = "defines_model"


def resumable(default: Any) -> Any:
    """A key (or a whole section) that changes how a step runs, what is logged or where things go, but not the
    numbers of the run: a run resumed with it changed goes on as an uninterrupted one would (layouts agree to
    float tolerance). Resuming with any other key changed is reported as making the run differ."""
    return dataclasses.field(default=default, metadata={RESUME: True})


def defines_model(default: Any, through: str | None = None) -> Any:
    """A model key whose value a checkpoint's parameters are tied to; `through`: the resolved value compared
    instead of the key's own (num_kv_heads=null and num_kv_heads=num_heads are one model: kv_heads)."""
    return dataclasses.field(default=default, metadata={MODEL: through or ""})


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def concerns(cls) -> list[tuple[str | None, list[str]]]:
    """A section's fields by concern, in field order: (title, its fields) from the class's CONCERNS (each title and
    the field its group starts at); one untitled group where the class has none."""
    names = [f.name for f in dataclasses.fields(cls)]
    starts = dict((first, title) for title, first in getattr(cls, "CONCERNS", ()))
    unknown = set(starts) - set(names)
    assert not unknown, f"{cls.__name__}.CONCERNS starts at fields it does not have: {sorted(unknown)}"
    assert not starts or names[0] in starts, f"{cls.__name__}.CONCERNS must start at its first field, {names[0]}"
    groups: list[tuple[str | None, list[str]]] = []
    for name in names:
        if name in starts or not groups:
            groups.append((starts.get(name), []))
        groups[-1][1].append(name)
    return groups
