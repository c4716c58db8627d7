"""Training precision: dynamic loss scaling for fp16 (the dtype of each `train.dtype`: device.DTYPES).

bf16 and fp16 follow the Megatron/DeepSpeed recipe: parameters and compute in the low dtype,
fp32 gradient accumulation, fp32 master weights and optimizer state (parallel/data/optimizer.py). fp16's
5 exponent bits cannot hold small gradients, so the loss is multiplied by a scale before
backward and the gradients divided by it before the step; the scale grows while steps succeed
and backs off (and the step is skipped) when a gradient overflows. bf16 has fp32's exponent
range and needs no scaling.
"""

from __future__ import annotations


class LossScaler:
    """Dynamic loss scale (torch.amp.GradScaler's rule): halve it on an overflow, double it after
    `growth_interval` overflow-free steps. Disabled, the scale stays 1 and every step runs.

    `update` must see the same verdict on every rank, or ranks would disagree on whether to step:
    the trainer passes whether the global gradient norm, reduced over the whole job, is finite.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 1000,
                 min_scale: float = 1.0):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0

    def update(self, finite: bool) -> bool:
        """Record this step's overflow verdict; returns whether the optimizer should step."""
        if not self.enabled:
            return True
        if not finite:
            self.scale = max(self.scale / 2, self.min_scale)
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= 2
            self.good_steps = 0
        return True

    def state_dict(self) -> dict:
        """What a checkpoint keeps, so a resumed fp16 run continues at the same scale."""
        return {"scale": self.scale, "good_steps": self.good_steps, "enabled": self.enabled}

    def load_state_dict(self, state: dict) -> None:
        """Continue a saved scale only where both runs scale the loss: a resume under another
        train.dtype keeps its own (fp16 after fp32 or bf16 starts at init_scale, not at the 1 of a
        run without scaling; bf16 or fp32 after fp16 scales nothing)."""
        if self.enabled and state.get("enabled", True):
            self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
