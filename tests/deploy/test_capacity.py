"""The instance catalog against the EC2 API snapshot, the capacity byte math and `s4kv capacity`."""

from __future__ import annotations

import dataclasses

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from deploy_support import REPO
from s4kv.runtime.sizing import capacity, catalog, model_shapes

QWEN7B_CONFIG = REPO / "configs" / "qwen2.5-7b-instruct.json"


def _moto_resource(*parts: str):
    moto_ec2 = pytest.importorskip("moto.ec2")
    return Path(moto_ec2.__file__).parent.joinpath("resources", *parts)


def test_catalog_matches_the_ec2_api_figures():
    api = json.loads(gzip.open(_moto_resource("instance_types.json.gz")).read())
    families = {name.split(".")[0] for name in api}
    for family in ("g5", "g6", "g6e", "p4d", "p5"):
        expected = {n for n in api if n.split(".")[0] == family}
        assert expected == {n for n in catalog.CATALOG if catalog.CATALOG[n].family == family}, family
    for name, row in catalog.CATALOG.items():
        info = api[name]
        [gpu] = info["GpuInfo"]["Gpus"]
        want = (gpu["Name"], gpu["Count"], gpu["MemoryInfo"]["SizeInMiB"])
        assert (row.gpu_model, row.gpu_count, row.gpu_mib) == want
        assert (row.vcpus, row.memory_mib) == (info["VCpuInfo"]["DefaultVCpus"], info["MemoryInfo"]["SizeInMiB"])
    assert catalog.CATALOG["g5.xlarge"].gpu_mib == catalog.CATALOG["g6.xlarge"].gpu_mib == 22888
    assert "p5" in families


def test_region_offerings_snapshot_is_current():
    import refresh_region_offerings

    committed = json.loads((REPO / "constructs_lib" / "region_offerings.json").read_text())
    assert committed == json.loads(json.dumps(refresh_region_offerings.offerings_from_moto(list(catalog.CATALOG))))


def test_unknown_instance_type_lists_the_catalog():
    with pytest.raises(ValueError, match="g6.xlarge"):
        catalog.instance_type("g7.mega")


def test_model_shape_from_config_json_matches_the_preset_and_param_count():
    from_file = model_shapes.load(str(QWEN7B_CONFIG))
    preset = model_shapes.load("Qwen/Qwen2.5-7B-Instruct")
    assert {**from_file.__dict__, "name": ""} == {**preset.__dict__, "name": ""}
    assert abs(from_file.num_params - 7.62e9) / 7.62e9 < 0.01  # published: 7.62B
    assert abs(model_shapes.load("meta-llama/Llama-3.1-70B-Instruct").num_params - 70.6e9) / 70.6e9 < 0.01
    with pytest.raises(ValueError, match="config.json"):
        model_shapes.load("nobody/no-such-model")


def test_kv_bytes_per_token():
    qwen = model_shapes.load("Qwen/Qwen2.5-7B-Instruct")  # 28 layers x 4 KV heads, head_dim 128
    plan = capacity.plan(qwen, catalog.instance_type("g6.xlarge"), "int4_kivi", 8192)
    assert {r.kv_format: r.bytes_per_token for r in plan.capacity} == {
        "bf16": 28 * 4 * 512, "fp8": 28 * 4 * 256, "int4": 28 * 4 * 136}


def test_capacity_counts_whole_pages_in_the_kv_pool():
    qwen = model_shapes.load("Qwen/Qwen2.5-7B-Instruct")
    g6 = catalog.instance_type("g6.xlarge")
    plan = capacity.plan(qwen, g6, "int4_kivi", 8192)
    pool = g6.gpu_mib * 2**20 * 0.9 - capacity.RUNTIME_RESERVE_MIB * 2**20 - qwen.weight_bytes
    for row in plan.capacity:
        block = capacity.KV_FORMATS[row.kv_format].block_size
        blocks = int(pool) // (block * row.bytes_per_token)
        assert row.tokens_per_replica == blocks * block
        assert row.concurrent_requests == blocks // (8192 // block)
    ratio = plan.for_format("int4").concurrent_requests / plan.for_format("bf16").concurrent_requests
    assert 3.5 < ratio < 4.5  # 512/136 = 3.76 more tokens, quantised to whole requests


def test_tensor_parallel_only_when_weights_do_not_fit_one_gpu():
    qwen = model_shapes.load("Qwen/Qwen2.5-7B-Instruct")
    llama70 = model_shapes.load("meta-llama/Llama-3.1-70B-Instruct")
    small = capacity.plan(qwen, catalog.instance_type("g6e.12xlarge"), "int4_kivi", 8192)
    assert (small.tensor_parallel, small.data_parallel) == (1, 4)
    big = capacity.plan(llama70, catalog.instance_type("p4d.24xlarge"), "int4_kivi", 8192)
    assert (big.tensor_parallel, big.data_parallel) == (4, 2)
    assert big.vllm_args() == ["--tensor-parallel-size", "4", "--data-parallel-size", "2",
                               "--max-model-len", "8192", "--gpu-memory-utilization", "0.9"]
    with pytest.raises(capacity.DoesNotFit):
        capacity.plan(llama70, catalog.instance_type("g6.xlarge"), "int4_kivi", 8192)


def test_int4_schemes_take_head_dim_64_at_its_own_bytes_per_token():
    small = model_shapes.load("Qwen/Qwen2.5-0.5B-Instruct")  # 24 layers x 2 KV heads, head_dim 64
    assert small.head_dim == 64
    plan = capacity.plan(small, catalog.instance_type("g6.xlarge"), "int4_saw", 8192)
    assert {r.kv_format: r.bytes_per_token for r in plan.capacity} == {
        "bf16": 24 * 2 * 256, "fp8": 24 * 2 * 128, "int4": 24 * 2 * 72}
    ratio = plan.for_format("int4").tokens_per_replica / plan.for_format("bf16").tokens_per_replica
    assert ratio == pytest.approx(256 / 72, rel=0.01)  # 3.56x, whole pages aside


def test_int4_schemes_refuse_other_head_dims():
    odd = dataclasses.replace(model_shapes.load("Qwen/Qwen2.5-7B-Instruct"), name="odd", head_dim=96)
    with pytest.raises(capacity.DoesNotFit, match="need head_dim 64 or 128, the model has 96"):
        capacity.plan(odd, catalog.instance_type("g6.xlarge"), "int4_saw")
    assert capacity.plan(odd, catalog.instance_type("g6.xlarge"), "bf16")


def test_capacity_command_offline_without_torch_or_vllm():
    code = (
        "import sys; from s4kv.runtime.cli import main\n"
        f"rc = main(['capacity', '--model', {str(QWEN7B_CONFIG)!r}, '--instance', 'g6.xlarge', '--context', '8192'])\n"
        "assert rc == 0 and 'torch' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.split()[:2] == ["int4", "15232"] for line in lines), result.stdout
    assert "--tensor-parallel-size 1 --data-parallel-size 1 --max-model-len 8192" in result.stdout
    assert "s4kv serve " in result.stdout and "--scheme int4_kivi" in result.stdout


def test_capacity_command_json_and_errors(capsys):
    from argparse import Namespace

    args = Namespace(model="Qwen/Qwen2.5-7B-Instruct", instance="p5.48xlarge", context=4096, scheme="int4_saw",
                     gpu_memory_utilization=0.9, json=True)
    assert capacity.run(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["data_parallel"] == 8 and plan["scheme"] == "int4_saw"
    assert capacity.run(Namespace(**{**vars(args), "context": 10**6, "json": False})) == 2
    assert "max_position_embeddings" in capsys.readouterr().out


def test_model_found_in_the_local_hugging_face_cache(tmp_path, monkeypatch):
    snapshot = tmp_path / "models--my-org--tiny" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(QWEN7B_CONFIG.read_text())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    shape = model_shapes.load("my-org/tiny")
    assert shape.name == "my-org/tiny" and shape.num_kv_heads == 4 and shape.head_dim == 128


def test_config_variants_text_config_moe_and_quantized_weights():
    base = json.loads(QWEN7B_CONFIG.read_text())
    nested = model_shapes.from_config({"architectures": ["X"], "text_config": base})
    assert nested.num_params == model_shapes.from_config(base).num_params
    moe = model_shapes.from_config({**base, "num_experts": 8, "moe_intermediate_size": 1024})
    assert moe.num_params - model_shapes.from_config(base).num_params == 28 * (
        8 * 3 * 3584 * 1024 + 3584 * 8 - 3 * 3584 * 18944)
    awq = model_shapes.from_config({**base, "quantization_config": {"quant_method": "awq", "bits": 4}})
    assert awq.weight_bytes == model_shapes.from_config(base).weight_bytes // 4
    with pytest.raises(ValueError, match="num_hidden_layers"):
        model_shapes.from_config({"hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10})
