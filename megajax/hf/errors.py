"""The error every Hugging Face conversion failure raises, and the JSON reading that the config mapping
(megajax/hf/configs.py) and the folder reader (megajax/hf/folders.py) share. The lowest module of megajax.hf: it
imports nothing else from the package, so every other module can import it."""

from __future__ import annotations

import json
from pathlib import Path

from megajax.config import InputError


class ConversionError(InputError):
    """A model that cannot be converted; the message names the tensor or config field."""


def read_json(path: Path) -> dict:
    """A JSON object from `path`; a file that is not one is a ConversionError naming it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: not valid JSON ({str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
