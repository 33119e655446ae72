"""The preflight's parts, their figures, and the three ways they are written: a table, JSON
with the same fields, and one summary line."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from megatron_gspo.runtime.errors import one_line

# Parts the summary line reads, by name.
STEP, FP8_STEP, LOGPROBS = "gspo step bf16", "gspo step fp8", "logprobs"
# Exit statuses: a part failed; nothing failed but the recipe needs a package not installed.
EXIT_FAILED, EXIT_MISSING = 1, 3


class Skip(Exception):
    """A part that cannot run on this machine; the message says why."""


@dataclass
class Part:
    name: str
    status: str = "ok"  # ok | skipped | failed | missing
    reason: str = ""
    figures: dict[str, object] = field(default_factory=dict)

    @property
    def status_text(self) -> str:
        return f"{self.status}: {self.reason}" if self.reason else self.status


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


@dataclass
class Report:
    size: str
    device: str = "cpu"  # the name the summary line gives the device
    parts: dict[str, Part] = field(default_factory=dict)
    # Called with each part as it ends: the command line writes it out at once, so a node
    # that hangs or a time limit that strikes later keeps what was measured.
    on_part: Callable[[Report, Part], None] | None = None

    @contextmanager
    def part(self, name: str) -> Iterator[Part]:
        """Run a part: ``Skip`` marks it skipped, any other exception failed (one line)."""
        part = self.parts[name] = Part(name)
        print(f"preflight: {name} ...", file=sys.stderr, flush=True)
        try:
            yield part
        except Skip as e:
            part.status, part.reason, part.figures = "skipped", str(e), {}
        except Exception as e:  # noqa: BLE001 - a preflight reports what broke and goes on
            part.status, part.reason = "failed", f"{type(e).__name__}: {one_line(e)}"
        finally:
            if self.on_part is not None:
                self.on_part(self, part)

    def rows(self) -> Iterator[tuple[str, str, object]]:
        for part in self.parts.values():
            yield part.name, "status", part.status_text
            for key, value in part.figures.items():
                yield part.name, key, value

    TABLE_HEAD = "| part | field | value |\n| --- | --- | --- |"

    def table(self) -> str:
        return "\n".join([self.TABLE_HEAD, *(self.part_rows(p) for p in self.parts.values())])

    @staticmethod
    def part_rows(part: Part) -> str:
        rows = [(part.name, "status", part.status_text)]
        rows += [(part.name, k, v) for k, v in part.figures.items()]
        return "\n".join(f"| {p} | {k} | {_fmt(v)} |" for p, k, v in rows)

    def to_json(self) -> dict:
        parts = {}
        for name, key, value in self.rows():
            if isinstance(value, float) and math.isnan(value):
                value = None
            parts.setdefault(name, {})[key] = value
        return {"size": self.size, "device": self.device, "parts": parts, "summary": self.summary()}

    def _figure(self, part: str, key: str) -> float:
        p = self.parts.get(part)
        value = p.figures.get(key) if p is not None else None
        return float(value) if isinstance(value, int | float) else float("nan")

    def summary(self) -> str:
        def num(part: str, key: str, spec: str) -> str:
            value = self._figure(part, key)
            return "n/a" if math.isnan(value) else format(value, spec)

        fp8 = self.parts.get(FP8_STEP)
        if fp8 is not None and fp8.status == "ok":
            fp8_text = f"fp8 {num(FP8_STEP, 'fp8/bf16 step time', '.2f')}x bf16"
        else:
            why = fp8.reason if fp8 is not None else "not run"
            if fp8 is not None and fp8.status == "failed":
                why = f"the FP8 step failed: {why}"
            fp8_text = f"fp8 unavailable: {why}"
        return (
            f"preflight: {self.device} step {num(STEP, 'tokens/s', '.0f')} tokens/s, "
            f"MFU {num(STEP, 'MFU %', '.3g')}%, "
            f"logprobs time {num(LOGPROBS, 'time ratio', '.2f')}x "
            f"memory {num(LOGPROBS, 'memory ratio', '.2f')}x naive, {fp8_text}"
        )

    def exit_code(self) -> int:
        statuses = {p.status for p in self.parts.values()}
        if "failed" in statuses:
            return EXIT_FAILED
        return EXIT_MISSING if "missing" in statuses else 0
