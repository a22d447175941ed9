"""The pre-flight check's reading of a request (megatron_rl/slurm_check.py): #SBATCH lines per het component,
command-line options over them, and Slurm's units; the check against a cluster runs on the Slurm tier."""

from __future__ import annotations

from megatron_rl.slurm_check import apply_command_line, gpu_count, memory_mb, minutes, script_requests

SCRIPT = """#!/bin/bash
# a comment
#SBATCH --job-name=x
#SBATCH --partition=gpu
#SBATCH --nodes=2
#SBATCH --gpus-per-node=8 --cpus-per-task 12
#SBATCH -t 24:00:00
#SBATCH hetjob
#SBATCH -p cpu
#SBATCH --mem=64G
echo hi
#SBATCH --nodes=9
"""


def test_the_scripts_lines_make_one_request_per_component(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(SCRIPT)
    gpu, cpu = script_requests(script)
    assert (gpu.partition, gpu.nodes, gpu.gpus_per_node, gpu.cpus_per_task, gpu.time) == ("gpu", "2", "8", "12",
                                                                                           "24:00:00")
    assert (cpu.partition, cpu.mem, cpu.nodes) == ("cpu", "64G", None)  # lines after the first command are not read
    gpu, cpu = apply_command_line(script_requests(script), ["--nodes=1", "-p", "debug", ":", "--mem", "1G"])
    assert (gpu.nodes, gpu.partition, gpu.gpus_per_node, cpu.mem) == ("1", "debug", "8", "1G")
    assert gpu.given["nodes"] == "--nodes=1"


def test_slurms_units():
    assert memory_mb("64G") == 65536 and memory_mb("500") == 500 and memory_mb("1T") == 1048576
    assert memory_mb("0") == 0
    assert minutes("15") == 15 and minutes("24:00:00") == 1440 and minutes("1-12") == 2160
    assert minutes("2-00:30:00") == 2910 and minutes("INFINITE") is None and minutes("10:30") == 10.5
    assert minutes("1-02:03:04") == 1440 + 123 + 4 / 60 and minutes("Partition_Limit") is None
    assert gpu_count("gpu:2") == 2 and gpu_count("gpu:a100:4(S:0-1)") == 4 and gpu_count("gpu:a100:4,shard:8") == 4
    assert gpu_count("(null)") == 0 and gpu_count("gpu:a100:4,gpu:h100:2") == 6
