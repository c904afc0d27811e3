"""schedule.py -- the learning-rate schedule train.py steps the engine with: linear warmup, then
cosine decay.

What it is
    lr_at(step, max_lr, total_steps, warmup, min_ratio): the learning rate of update `step` (from
    0), as nanoGPT and most LLM recipes schedule it; the engine takes it through Trainer.set_lr
    before each step.
What it is not
    Not a torch.optim.lr_scheduler: the engine's optimizer is optim.HostStore, which takes the rate
    per call.
Tested in tests/core/test_optim.py (the schedule's values at its corners).
"""
import math


def lr_at(step, max_lr, total_steps, warmup=0, min_ratio=0.1):
    """Linear warmup to max_lr over `warmup` steps, then cosine decay to min_ratio * max_lr at
    total_steps. step counts from 0 (the first update uses lr_at(0))."""
    if warmup and step < warmup:
        return max_lr * (step + 1) / warmup
    if total_steps <= warmup:
        return max_lr
    t = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return max_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))
