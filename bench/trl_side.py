"""The TRL side of bench/vs_trl.py, run by it with the Python of TRL's own environment (TRL is not a dependency of
moe-rl): TRL's GRPOTrainer on the model, prompts and reward moe-rl trains with, with the settings the spec file
gives. Prints one JSON line: the wall time of each RL step (one generation of the step's samples and the
mini-batch updates on them), the mean reward of each step's samples, and the whole run's time from the start of
this process.

  <trl env>/bin/python bench/trl_side.py SPEC.json
"""

from __future__ import annotations

import json
import sys
import time

START = time.perf_counter()

import torch  # noqa: E402  (after START: the import is part of the run's time, as in moe-rl's)


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    torch.set_num_threads(spec["threads"])
    sys.path.insert(0, spec["repo"])  # moe-rl's reward function itself (moe_rl.data imports only the stdlib)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from moe_rl.data.rewards import toy_low_token_reward

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    # fp32 weights; bf16: accelerate's autocast around every forward (mixed precision, fp32 master weights)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    step_rewards: list[float] = []

    def toy_reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
        scores = toy_low_token_reward(completions, [None] * len(completions), completion_ids)
        step_rewards.append(sum(scores) / len(scores))
        return scores

    mini_batches = spec["mini_batches"]

    class StepTimes(TrainerCallback):
        """Optimizer steps 2k-1 and 2k (with 2 mini-batches) are RL step k: the first one generates."""

        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.began = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            took = time.perf_counter() - self.began
            if (state.global_step - 1) % mini_batches == 0:
                self.seconds.append(took)
            else:
                self.seconds[-1] += took

    samples = spec["prompts_per_step"] * spec["samples_per_prompt"]
    config = GRPOConfig(
        output_dir=spec["out_dir"],
        report_to="none",
        save_strategy="no",
        logging_steps=1_000_000,
        use_cpu=True,
        bf16=spec["dtype"] == "bfloat16",
        seed=spec["seed"],
        dataloader_num_workers=0,
        max_steps=spec["steps"] * mini_batches,
        per_device_train_batch_size=samples // mini_batches,
        gradient_accumulation_steps=1,
        steps_per_generation=mini_batches,
        num_generations=spec["samples_per_prompt"],
        max_completion_length=spec["max_tokens"],
        temperature=spec["temperature"],
        top_p=1.0,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=spec["adam_betas"][0],
        adam_beta2=spec["adam_betas"][1],
        adam_epsilon=spec["adam_eps"],
        max_grad_norm=spec["grad_clip"],
        beta=0.0,
        num_iterations=1,
        epsilon=spec["clip_low"],
        epsilon_high=spec["clip_high"],
        importance_sampling_level="sequence",
        loss_type="grpo",  # token mean per sample, then the mean over samples: moe-rl's seq-mean-token-mean
        scale_rewards="group",
        disable_dropout=True,
        router_aux_loss_coef=0.0,  # moe-rl trains RL without a load-balancing loss (moe_aux_loss_coeff=0)
    )
    times = StepTimes()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=toy_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": spec["prompts"]}),
        processing_class=tokenizer,
        callbacks=[times],
    )
    trainer.train()
    print(
        json.dumps(
            {
                "step_seconds": times.seconds,
                "rewards": step_rewards,
                "whole_seconds": time.perf_counter() - START,
                "parameters": sum(p.numel() for p in model.parameters()),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
