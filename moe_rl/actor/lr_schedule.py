"""The learning-rate schedule of an optimizer (the actor's, the critic's, SFT's): linear warmup from 0, then constant,
linear or cosine decay to a minimum, by trainer step. megatron-core's OptimizerParamScheduler computes it and sets
it on the optimizer's parameter groups; the trainer moves it to its step before each update, so a resumed run trains
at the uninterrupted run's learning rates whatever the checkpoint holds.

With W warmup steps, decay end D, peak `lr` and `min_lr`, step s (1-based) trains at
    lr * s / W                                                   s <= W
    min_lr + (lr - min_lr) * (1 + cos(pi (s - W) / (D - W))) / 2   W < s <= D   (cosine; linear: 1 - (s - W) / (D - W))
    min_lr                                                       s > D        (lr throughout under constant)
"""

from __future__ import annotations


class LRSchedule:
    def __init__(self, optimizer, section, steps: int, weight_decay: float):
        """`optimizer`: a megatron optimizer (its `param_groups`); `section`: the config section with lr,
        lr_warmup_steps, lr_decay, lr_decay_steps and min_lr (actor.*, critic.*); `steps`: trainer.steps, where the
        decay ends when lr_decay_steps is null; `weight_decay`: the optimizer's (kept as it is)."""
        # heavy: megatron-core, imported on first use
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        warmup = section.lr_warmup_steps
        decay_end = section.lr_decay_steps if section.lr_decay_steps is not None else steps
        self.optimizer = optimizer
        self.scheduler = OptimizerParamScheduler(
            optimizer,
            init_lr=0.0,
            max_lr=section.lr,
            min_lr=section.min_lr,
            lr_warmup_steps=warmup,
            lr_decay_steps=max(decay_end, warmup + 1),  # a run shorter than its warmup never decays
            lr_decay_style=str(section.lr_decay),
            start_wd=weight_decay,
            end_wd=weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )

    def at(self, step: int) -> float:
        """Set the learning rate of trainer step `step` (1-based) on every parameter group; the rate they hold."""
        self.scheduler.num_steps = 0
        self.scheduler.step(step)
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict:
        """The schedule's settings and the step it was last moved to (kept in the checkpoint's trainer state)."""
        return self.scheduler.state_dict()
