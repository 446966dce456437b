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


def test_hotspots_rank_instructions_by_stall_samples():
    source = "\n".join([
        '"Kernel Name","_paged_attention_kernel",',
        '"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb","stall_wait",'
        '"stall_long_sb (Not Issued)"',
        '"0x10","LDG.E.U16 R19, desc[UR14][R44.64+0x14]","10","0","10","0"',
        '"0x20","PRMT R18, R18, 0x5410, R19","70","65","5","65"',
        '"0x30","HMMA.16816.F32 R0, R4, R8, R0","20","0","20","0"',
    ])
    lines = pd.hotspots(source, count=2).splitlines()
    assert lines[2] == "| 70.0% | `PRMT R18, R18, 0x5410, R19` | long_sb 65, wait 5 |"  # largest first
    assert lines[3].startswith("| 20.0% | `HMMA.16816.F32")
    assert len(lines) == 4  # header, rule and the two asked for
    assert pd.hotspots('"Kernel Name","x",\n"Address","Source"') == "no source counters\n"
