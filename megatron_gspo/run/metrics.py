"""Per-step metrics: a JSONL file (the record plots and tests read), TensorBoard, W&B."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from megatron_gspo.runtime.errors import InputError

METRICS_FILE = "metrics.jsonl"

log = logging.getLogger(__name__)


class MetricsFileError(InputError):
    """A metrics file with a line that is not a JSON record; the message names file:line."""


def parse_metrics(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The records of a metrics file, and its last line where that is cut short.

    A last line that is not a JSON object is what an interrupted write (a kill, a full disk)
    leaves: it is returned apart, for the caller to drop with a warning. A bad line before the
    last is an error naming the file and line: something other than this trainer wrote it.
    """
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if number == len(lines):
                return records, line
            msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
            raise MetricsFileError(f"{path}:{number}: not a metrics record ({msg})") from None
        records.append(record)
    return records, None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every complete record of ``run_dir``'s metrics (a cut-short last line is left out,
    with a warning)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics (is {run_dir} a run directory?)")
    records, partial = parse_metrics(path)
    if partial is not None:
        log.warning("%s: the last line is cut short (an interrupted write); left out", path)
    return records


class MetricsLogger:
    """Writes on the rank that logs; a no-op elsewhere."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        tensorboard: bool,
        wandb_project: str | None,
        config: dict | None = None,
    ) -> None:
        self.enabled = enabled
        self.path = run_dir / METRICS_FILE
        self._tb = self._wandb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb_project:
            from megatron_gspo.runtime.extras import require_extra

            wandb = require_extra(
                "wandb", "Logging to Weights & Biases (run.wandb_project)", extra="wandb"
            )
            self._wandb = wandb.init(project=wandb_project, config=config, resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # a full disk: name the file
            raise OSError(e.errno, e.strerror, str(self.path)) from e
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
