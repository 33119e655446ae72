"""Per-step metrics: a JSONL file (the record plots and tests read), TensorBoard, W&B."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics (is {run_dir} a run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLogger:
    """Writes on the rank that logs; a no-op elsewhere."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        tensorboard: bool,
        wandb_project: str | None,
        resume_step: int = 0,
        config: dict | None = None,
    ) -> None:
        self.enabled = enabled
        self.path = run_dir / METRICS_FILE
        self._tb = self._wandb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb_project:
            from megatron_gspo.extras import require_extra

            wandb = require_extra(
                "wandb", "Logging to Weights & Biases (run.wandb_project)", extra="wandb"
            )
            self._wandb = wandb.init(project=wandb_project, config=config, resume="allow")

    def _truncate_after(self, step: int) -> None:
        """A resumed run repeats the steps after its checkpoint: drop their old lines."""
        if not self.path.is_file():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        self.path.write_text("".join(f"{line}\n" for line in kept))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, float | int):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
