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
        staging = plan.staging_bytes_per_gpu if row.kv_format == "int4" else 0  # int4_kivi's pool: its format only
        blocks = (int(pool) - staging) // (block * row.bytes_per_token)
        assert row.tokens_per_replica == blocks * block
        assert row.concurrent_requests == blocks // (8192 // block)
    saw = capacity.plan(qwen, g6, "int4_saw", 8192)
    assert saw.staging_bytes_per_gpu == 0
    for scheme_plan in (plan, saw):
        ratio = scheme_plan.for_format("int4").concurrent_requests / scheme_plan.for_format("bf16").concurrent_requests
        assert 3.2 < ratio < 4.5  # 512/136 = 3.76 more tokens (at least 7/8 of it for int4_kivi), whole requests


def test_vllm_default_max_num_seqs_follows_the_gpu():
    # vLLM 0.26 EngineArgs.get_batch_defaults: 1,024 from 70 GiB unless an A100, else 256
    assert {name: capacity.vllm_default_max_num_seqs(catalog.instance_type(name))
            for name in ("g5.xlarge", "g6e.xlarge", "p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge")} == {
        "g5.xlarge": 256, "g6e.xlarge": 256, "p4d.24xlarge": 256, "p4de.24xlarge": 256, "p5.48xlarge": 1024}


def test_staging_slot_bytes_are_the_plugins_pool():
    """The planner's slot is what the backend allocates per max_num_seqs slot, summed over the layers."""
    torch = pytest.importorskip("torch")
    from s4kv.kernels.layout import KIVI_BLOCK_SIZE
    from s4kv.kernels.staging import allocate_pool

    model = model_shapes.load("meta-llama/Llama-3.1-70B-Instruct")
    for tp in (1, 2, 8):
        heads = -(-model.num_kv_heads // tp)
        pool = allocate_pool(3, heads, KIVI_BLOCK_SIZE, model.head_dim, torch.bfloat16, "meta")  # one layer's
        assert pool.nbytes * model.num_layers == 3 * capacity.staging_bytes_per_slot(model, tp)


@pytest.mark.parametrize("model_id", ["meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct"])
@pytest.mark.parametrize("instance_name", ["g5.xlarge", "g6e.xlarge", "p5.48xlarge"])
def test_int4_kivi_caps_max_num_seqs_by_its_staging_pool(model_id, instance_name):
    model = model_shapes.load(model_id)
    instance = catalog.instance_type(instance_name)
    kivi = capacity.plan(model, instance, "int4_kivi", 8192)
    saw = capacity.plan(model, instance, "int4_saw", 8192)
    assert kivi.tensor_parallel == saw.tensor_parallel == 1
    slot = capacity.KV_FORMATS["int4"].block_size * model.num_layers * model.num_kv_heads * model.head_dim * 2
    assert capacity.staging_bytes_per_slot(model, 1) == slot
    assert kivi.staging_bytes_per_gpu == kivi.max_num_seqs * slot
    budget = instance.gpu_mib * 2**20 * 0.9 - capacity.RUNTIME_RESERVE_MIB * 2**20 - model.weight_bytes
    default = capacity.vllm_default_max_num_seqs(instance)
    assert kivi.max_num_seqs % 16 == 0 and kivi.max_num_seqs <= default == saw.max_num_seqs
    assert kivi.staging_bytes_per_gpu <= budget / 8
    if kivi.max_num_seqs < default:  # the most slots the share holds
        assert (kivi.max_num_seqs + 16) * slot > budget / 8
    assert kivi.vllm_args()[-2:] == ["--max-num-seqs", str(kivi.max_num_seqs)]
    kivi_tokens = kivi.for_format("int4").tokens_per_replica
    saw_tokens = saw.for_format("int4").tokens_per_replica
    assert kivi_tokens == (int(budget) - kivi.staging_bytes_per_gpu) // (128 * model.num_layers * model.num_kv_heads
                                                                        * 136) * 128
    assert 7 / 8 * saw_tokens - 128 <= kivi_tokens < saw_tokens
    assert kivi.for_format("bf16") == saw.for_format("bf16")  # the pool is int4_kivi's alone


def test_tensor_parallel_only_when_weights_do_not_fit_one_gpu():
    qwen = model_shapes.load("Qwen/Qwen2.5-7B-Instruct")
    llama70 = model_shapes.load("meta-llama/Llama-3.1-70B-Instruct")
    small = capacity.plan(qwen, catalog.instance_type("g6e.12xlarge"), "int4_kivi", 8192)
    assert (small.tensor_parallel, small.data_parallel) == (1, 4)
    big = capacity.plan(llama70, catalog.instance_type("p4d.24xlarge"), "int4_kivi", 32768)
    # TP 4 holds a 32k request, but TP 8 leaves each GPU 1/8 of the weights and far more KV: more requests.
    assert (big.tensor_parallel, big.data_parallel) == (8, 1)
    assert big.vllm_args() == ["--tensor-parallel-size", "8", "--data-parallel-size", "1",
                               "--max-model-len", "32768", "--gpu-memory-utilization", "0.9",
                               "--max-num-seqs", str(big.max_num_seqs)]
    p4d = catalog.instance_type("p4d.24xlarge")
    layouts = {tp: capacity._blocks_per_gpu(llama70, p4d, tp, 0.9, capacity.KV_FORMATS["int4"],
                                            capacity._staging_bytes_per_gpu(llama70, p4d, tp, 0.9, "int4_kivi"))
               // (32768 // 128) * (8 // tp) for tp in (4, 8)}
    assert big.for_format("int4").concurrent_requests == layouts[8] > layouts[4] >= 1
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
