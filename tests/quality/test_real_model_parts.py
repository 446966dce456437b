"""tools/device/real_model_parts.py: a packaged GGUF file cut into per-command parts, stashed as they arrive in any
order, joined back byte for byte, found by `s4kv model fetch`'s package lookup, and the converted tensors checked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tools.device import real_model_parts as parts

PACKAGE = {"model": "fake", "distribution": "fake-model-pkg", "version": "1.2.3", "gguf": "fake_model_pkg/m.gguf"}


@pytest.fixture
def split_model(tmp_path):
    """A 2.5 MiB stand-in GGUF and a converted folder, split into 1 MiB parts: (folders, gguf bytes, converted)."""
    data = np.random.default_rng(0).integers(0, 256, (5 << 19) + 17, dtype=np.uint8).tobytes()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(data)
    converted = tmp_path / "converted"
    converted.mkdir()
    save_file({"a.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "b.bias": np.ones(5, np.float32)},
              str(converted / "model.safetensors"))
    folders = parts.split(gguf, dict(PACKAGE), converted, tmp_path / "out", 1 << 20)
    return folders, data, converted


def carry(folder: Path, carried: Path) -> None:
    """What a device command does with a carried path: the folder appears under the checkout's .realmodel."""
    shutil.copytree(folder, carried / folder.name)


def test_parts_round_trip_in_any_order(split_model, tmp_path, capsys):
    folders, data, converted = split_model
    assert [f.name for f in folders] == ["1", "2", "3"]
    sizes = [sum(p.stat().st_size for p in f.glob("*.part*")) for f in folders]
    assert max(sizes) <= 1 << 20 and sum(sizes) == len(data)
    assert (folders[0] / parts.SUPPORT / "gguf" / "__init__.py").is_file()  # the reader travels with part 1
    carried, stash = tmp_path / "carried", tmp_path / "stash"

    carry(folders[2], carried)
    assert parts.main(["stash", "--carried", str(carried), "--stash", str(stash)]) == 0
    assert "still to carry: m.gguf.part0, m.gguf.part1, site/" in capsys.readouterr().out
    assert parts.main(["assemble", "--stash", str(stash)]) == parts.NOT_COMPLETE_EXIT
    assert "still to carry" in capsys.readouterr().err

    for folder in folders[:2]:
        carry(folder, carried)
    assert parts.main(["stash", "--carried", str(carried), "--stash", str(stash)]) == 0
    assert "every part is stashed" in capsys.readouterr().out
    assert not list(carried.rglob("*.part*"))  # moved, not copied: the checkout keeps no second copy
    assert parts.main(["assemble", "--stash", str(stash)]) == 0
    site = Path(capsys.readouterr().out.strip())
    assert (site / PACKAGE["gguf"]).read_bytes() == data
    assert not list(stash.glob("*.part*"))
    assert parts.main(["assemble", "--stash", str(stash)]) == 0  # joined once; a later command finds it done

    # the package lookup `s4kv model fetch` uses finds the joined file, and `gguf` resolves to the carried copy
    probe = ("import gguf, json; from s4kv.runtime.packaged_models import PackagedModel, gguf_file;"
             f"path, version = gguf_file(PackagedModel('fake', {PACKAGE['distribution']!r}, {PACKAGE['gguf']!r}, "
             "'f', 'd')); print(json.dumps([str(path), version, gguf.__file__]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    found = json.loads(subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                                      check=True).stdout)
    assert found[0] == str(site / PACKAGE["gguf"]) and found[1] == PACKAGE["version"]
    assert found[2].startswith(str(site / "gguf"))

    assert parts.main(["verify", str(converted), "--stash", str(stash)]) == 0
    save_file({"a.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "b.bias": np.full(5, 1.5, np.float32)},
              str(converted / "model.safetensors"))
    assert parts.main(["verify", str(converted), "--stash", str(stash)]) == 2
    error = capsys.readouterr().err
    assert "1 of 2 tensors" in error and "b.bias" in error


def test_a_damaged_part_is_refused_and_stays(split_model, tmp_path, capsys):
    folders, _, _ = split_model
    carried, stash = tmp_path / "carried", tmp_path / "stash"
    carry(folders[1], carried)
    part = next((carried / "2").glob("*.part*"))
    damaged = bytearray(part.read_bytes())
    damaged[1000] ^= 1
    part.write_bytes(bytes(damaged))
    assert parts.main(["stash", "--carried", str(carried), "--stash", str(stash)]) == 2
    assert "does not match" in capsys.readouterr().err
    assert part.is_file() and not list(stash.glob("*.part*"))


def test_parts_of_another_file_are_refused(split_model, tmp_path, capsys):
    folders, _, converted = split_model
    carried, stash = tmp_path / "carried", tmp_path / "stash"
    carry(folders[0], carried)
    assert parts.main(["stash", "--carried", str(carried), "--stash", str(stash)]) == 0
    other = tmp_path / "other.gguf"
    other.write_bytes(b"another file" * 1000)
    shutil.rmtree(carried)
    carry(parts.split(other, dict(PACKAGE), converted, tmp_path / "other-out", 1 << 20)[0], carried)
    assert parts.main(["stash", "--carried", str(carried), "--stash", str(stash)]) == 2
    assert "belongs to another file" in capsys.readouterr().err


def test_stash_without_carried_parts_says_so(tmp_path, capsys):
    assert parts.main(["stash", "--carried", str(tmp_path / "none"), "--stash", str(tmp_path / "stash")]) == 0
    assert "nothing carried" in capsys.readouterr().out
    assert parts.main(["assemble", "--stash", str(tmp_path / "stash")]) == 2
    assert "run `split` here" in capsys.readouterr().err
