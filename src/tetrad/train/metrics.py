"""Per-step metrics: `RUN_DIR/metrics.jsonl` (a contract, DESIGN.md) and the rank-0 progress bar."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm

# Fields every line carries (DESIGN.md, metrics.jsonl contract).
CONTRACT_FIELDS = ("step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "mfu",
                   "compute_s", "exposed_comm_s", "bubble_s", "comm_bytes")


class MetricsLog:
    """Appends one JSON object per optimizer step and drives the progress bar (rank 0 only)."""

    def __init__(self, run_dir: Path, total_steps: int, first_step: int, enabled: bool):
        self.enabled = enabled
        self.file = None
        self.bar = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.file = open(run_dir / "metrics.jsonl", "a" if first_step else "w")
            self.bar = tqdm(total=total_steps, initial=first_step, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr, mininterval=0.5)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.file.close()
