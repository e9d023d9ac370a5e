"""megajax: Megatron-style training of GPT-style models in JAX."""

import os as _os
import sys as _sys

# A command (`python -m megajax.<command>`, while Python locates the module, or the `megajax` script) imports jax
# without the CUDA plugin's driver probes on a machine without a GPU (megajax/quiet.py). A library import leaves
# jax alone: code that sets JAX_* variables after importing megajax keeps them.
if _sys.argv[:1] == ["-m"] or _os.path.basename(_sys.argv[0] if _sys.argv else "") == "megajax":
    from megajax import quiet as _quiet

    _quiet.import_jax()
