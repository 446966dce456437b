"""CPU checks of tools/device/profile_decode.py: its case list and the summary it makes of ncu's raw metrics."""

from tools.device import profile_decode as pd


def test_cases_parse_shape_batch_and_context():
    assert pd.parse_cases("qwen2.5-7b:256x4096,llama-3.1-8b:1x32768") == [("qwen2.5-7b", 256, 4096),
                                                                        ("llama-3.1-8b", 1, 32768)]


def test_summary_scales_base_units_and_ranks_stall_reasons():
    kernel = {"Kernel Name": "_paged_attention_kernel", "gpu__time_duration.sum": "411000",
              "dram__bytes_read.sum": "598922490", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "30.8",
              "launch__registers_per_thread": "168",
              f"{pd.STALL_PREFIX}long_scoreboard{pd.STALL_SUFFIX}": "3.02",
              f"{pd.STALL_PREFIX}wait{pd.STALL_SUFFIX}": "1.32",
              f"{pd.STALL_PREFIX}sleeping{pd.STALL_SUFFIX}": "0"}
    row = pd.summary([kernel], ["s4kv_kivi qwen2.5-7b 256x4096"]).splitlines()[2]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:6] == ["s4kv_kivi qwen2.5-7b 256x4096", "_paged_attention_kernel", "411.0", "598.9", "30.8", "n/a"]
    assert cells[-1] == "long_scoreboard 3.02, wait 1.32"  # largest first; zero reasons left out
