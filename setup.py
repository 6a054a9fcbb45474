"""gspo-megatron: GSPO reinforcement learning for Mixture-of-Experts models on Megatron-Core."""

from setuptools import find_packages, setup

setup(
    name="gspo-megatron",
    version="0.1.0",
    description="GSPO (Group Sequence Policy Optimization) training backend on Megatron-Core with SGLang rollouts",
    # Tested: Python 3.11 with megatron-core 0.16.1 (every test) and Python 3.12 with megatron-core 0.19.2 (the
    # Megatron-side tests, docs/cpu-and-versions.md "Megatron-Core versions"). 3.10 and 3.13 have never run.
    python_requires=">=3.11,<3.13",
    packages=find_packages(include=["gspo_megatron", "gspo_megatron.*", "patches", "patches.*"]),
    install_requires=[
        "torch>=2.6",
        # The tested release for each Python: 0.16.1 is the last for 3.11; 0.17 onwards require 3.12.
        # patches/megatron_cpu.py (CPU only) refuses any other version.
        "megatron-core==0.16.1; python_version < '3.12'",
        "megatron-core>=0.19.2,<0.20; python_version >= '3.12'",
        # torch_dist checkpoint writer needs it but megatron-core does not declare it.
        "psutil",
        "numpy",
        "pyyaml",
        "safetensors",
        "transformers>=4.51",
        "matplotlib",
        "tqdm",
        # data.prompts in parquet (verl's layout, most RL sets) and Hugging Face datasets saved to disk
        "pyarrow",
        "datasets",
        # The math reward's equivalence of answers (rewards/math_answer.py; Apache-2.0; its latex2sympy2_extended is
        # MIT, sympy BSD, the ANTLR runtime BSD). The extra pins the ANTLR runtime its LaTeX grammar was built for.
        "math-verify[antlr4_13_2]>=0.9,<0.10",
    ],
    extras_require={
        # GPU-only: TransformerEngine needs CUDA torch and NCCL at build and import time.
        # TransformerEngine per megatron-core release (docs/cpu-and-versions.md "Megatron-Core versions"): 0.16.1
        # declares >=2.9,<2.12 (its dev extra); 0.19.2 declares no bound, and its source knows TE releases up to 2.14
        # (features gated on is_te_min_version("2.14.0"), none later), so later ones are not admitted until they have
        # run.
        "gpu": [
            "transformer-engine[pytorch]>=2.9,<2.12; python_version < '3.12'",
            "transformer-engine[pytorch]>=2.9,<2.15; python_version >= '3.12'",
            "triton",
            # the gated-DeltaNet hybrids' kernels (megatron's GatedDeltaNet imports fla on CUDA; the CPU uses
            # ops.gated_delta_rule through patches/megatron_gated_deltanet.py)
            "flash-linear-attention>=0.6.0,<0.7",
        ],
        # On GPUs: the normal install. On CPU use tools/install.sh (sglang --no-deps + patches/sglang_cpu).
        "sglang": ["sglang==0.5.23", "sglang-router==0.3.2"],
        # triton: the log-prob kernels' tests run them under its interpreter (TRITON_INTERPRET=1) on CPU tensors.
        "test": ["pytest", "triton"],
    },
    entry_points={"console_scripts": ["gspo-megatron=gspo_megatron.cli:main"]},
)
