"""Small typed CDK constructs of the S4 KV deployment (composed by stacks/).

They size models with this repository's stdlib-only sizing code (s4kv.runtime's catalog, model_shapes and
capacity). Where the s4kv package is not installed (a CDK-only environment: requirements.txt, no torch, triton
or vLLM), ``s4kv`` is made to resolve to this tree, so ``s4kv.runtime`` is the folder runtime/ next to this one.
"""

import importlib.util
import sys
import types
from pathlib import Path

if importlib.util.find_spec("s4kv") is None:
    _package = types.ModuleType("s4kv", "this repository's tree (constructs_lib/__init__.py)")
    _package.__path__ = [str(Path(__file__).resolve().parent.parent)]
    sys.modules["s4kv"] = _package
