"""The ``megatron-gspo`` command line."""

from __future__ import annotations

import contextlib
import sys
import warnings

import click

from megatron_gspo.launch import launch
from megatron_gspo.launch.plan import plan
from megatron_gspo.run.recipe import load_recipe
from megatron_gspo.run.signals import catch_sigterm
from megatron_gspo.runtime.errors import UserError, debug_enabled, one_line
from megatron_gspo.runtime.extras import MissingExtraError, check_recipe_extras


def report(error: BaseException) -> None:
    """A user's mistake as one line on stderr; with ``MEGATRON_GSPO_DEBUG=1`` the traceback
    first."""
    if debug_enabled():
        import traceback

        traceback.print_exception(error)
    click.echo(f"Error: {one_line(error)}", err=True)


class _Commands(click.Group):
    """The one place every command's errors end: a known user error (a recipe, a file, a
    checkpoint, a run directory) becomes one line and exit 1; anything else is a bug and keeps
    its traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.exceptions.ClickException:
            raise
        except Exception as e:
            if not isinstance(e, UserError):
                raise
            report(e)
            ctx.exit(1)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="megatron-gspo")
def main() -> None:
    """GSPO reinforcement learning for Mixture-of-Experts models on Megatron-Core."""
    # Megatron warns about apex and fused kernels it falls back from; the fallbacks are the
    # documented CPU path here, so the warnings only bury the run's own output.
    warnings.filterwarnings("ignore", module="megatron.core")


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option(
    "--no-extras-check",
    is_flag=True,
    help="Check the recipe only, not whether this machine has its packages (FP8) and inputs "
    "(data, tokenizer, init_from, reward modules, a writable run directory).",
)
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="The run directory train would use (default: the recipe's run.output_dir).",
)
def validate(recipe: str, no_extras_check: bool, output_dir: str | None) -> None:
    """Check RECIPE as train would before its first step: keys, types, the parallel layout
    against the model, reward functions and their kwargs, the tokenizer, the run directory,
    the checkpoint a run would start from against the model, needed extras, input files.

    Exit 1: the recipe is invalid. Exit 3: it is valid but cannot run on this machine (an extra
    or a reward module is not installed, an input file is missing, the run directory cannot be
    written: a GPU recipe checked on a laptop)."""
    from megatron_gspo.model import check_layout
    from megatron_gspo.run.checks import checkpoint_problem, find_problems, python_tool
    from megatron_gspo.run.recipe import missing_inputs

    r = load_recipe(recipe)
    check_layout(r.model, r.parallel)
    tool = None
    if not no_extras_check:
        from pydantic import ValidationError

        with contextlib.suppress(ValidationError):  # find_problems names what is wrong
            tool = python_tool(r)
    if tool is not None:
        click.echo(
            f"{recipe}: {tool[0]}" + (f" (not here: {tool[1]})" if tool[1] else " (works here)")
        )
    run_dir = output_dir or r.run.output_dir
    found = find_problems(r, run_dir)
    found += [p for p in [checkpoint_problem(r, run_dir)] if p is not None]
    invalid = [p.message for p in found if not p.here_only]
    if invalid:
        raise click.ClickException(f"{recipe}: " + "; ".join(invalid))
    if not no_extras_check:
        problems = missing_inputs(r) + [p.message for p in found if p.here_only]
        try:
            check_recipe_extras(r)
        except MissingExtraError as e:
            problems.append(str(e))
        if problems:
            detail = "; ".join(problems)
            click.echo(f"{recipe}: recipe ok, but not runnable on this machine: {detail}", err=True)
            sys.exit(3)
    click.echo(f"{recipe}: ok")


@main.command(
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def convert(args: tuple[str, ...]) -> None:
    """Convert checkpoints: hf-to-megatron SRC DST | megatron-to-hf SRC DST (see --help)."""
    from megatron_gspo.weights.convert import main as convert_main

    sys.exit(convert_main(list(args)))


def _setup_logging() -> None:
    import logging
    import os

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # Megatron logs every parameter name and its full configs at INFO.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    # httpx logs every request at INFO: thousands a step against vLLM servers.
    logging.getLogger("httpx").setLevel(logging.WARNING)


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Run directory (default: the recipe's run.output_dir).",
)
@click.option(
    "--resume/--no-resume",
    default=True,
    show_default=True,
    help="Continue from the newest checkpoint in the run directory, if there is one.",
)
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Override run.steps.")
@click.option(
    "--overwrite",
    is_flag=True,
    help="With --no-resume: delete the run already in the run directory (checkpoints, "
    "metrics, TensorBoard, plots) instead of refusing.",
)
@click.option(
    "--resume-from-last-good",
    is_flag=True,
    help="Where checkpoints/latest fails verification, resume from the newest checkpoint "
    "that verifies (the steps after it are trained again).",
)
@click.option(
    "--trust-unverified-checkpoint",
    is_flag=True,
    help="Resume from a checkpoint without a manifest.json (written before manifests, or "
    "the manifest was lost): its files cannot be checked.",
)
def train(
    recipe: str,
    output_dir: str | None,
    resume: bool,
    steps: int | None,
    overwrite: bool,
    resume_from_last_good: bool,
    trust_unverified_checkpoint: bool,
) -> None:
    """Train the policy of RECIPE with GSPO (one process, or one per rank under torchrun).

    Exit status 0: finished; 1: an error (one line on stderr); 75: stopped by SIGTERM
    (pre-emption, time limit) after saving a checkpoint, or during start-up before there was
    anything to save: run the same command to resume."""
    catch_sigterm()  # before the imports and start-up that take seconds
    _setup_logging()
    r = load_recipe(recipe)
    check_recipe_extras(r)
    from megatron_gspo.parallel import destroy_parallel
    from megatron_gspo.run.loop import Preempted
    from megatron_gspo.run.loop import train as run_training
    from megatron_gspo.run.signals import EXIT_PREEMPTED

    try:
        run_dir = run_training(
            r,
            output_dir=output_dir or r.run.output_dir,
            resume=resume,
            steps=steps,
            overwrite=overwrite,
            resume_from_last_good=resume_from_last_good,
            trust_unverified=trust_unverified_checkpoint,
        )
    except Preempted as e:
        click.echo(f"{e}; exit {EXIT_PREEMPTED}: resume with the same command", err=True)
        sys.exit(EXIT_PREEMPTED)
    finally:
        destroy_parallel()
    click.echo(f"run directory: {run_dir}")


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="PNG path.")
def plot(run_dir: str, out: str | None) -> None:
    """Plot reward, clip fraction, KL, entropy, length and flip rate of RUN_DIR."""
    from megatron_gspo.run.plot import plot_run

    click.echo(plot_run(run_dir, out))


@main.command()
@click.option(
    "--size",
    type=click.Choice(["tiny", "h100", "h200"]),
    default="tiny",
    show_default=True,
    help="tiny: CPU-sized; h100, h200: a Qwen3-30B-A3B slice filling one such GPU.",
)
@click.option(
    "--recipe",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also report which optional packages this recipe needs that are missing here.",
)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None)
def preflight(size: str, recipe: str | None, json_out: str | None) -> None:
    """Prove this node ready before a large job: versions, TE and FP8, vLLM, NCCL, matrix and
    copy rates, the loss layer, one GSPO step of a Qwen3-30B-A3B slice and the embedded engine.

    Exit 0: every part that ran passed; 1: a part failed; 3: the recipe needs a missing extra."""
    import json
    from pathlib import Path

    from megatron_gspo.preflight.report import Report
    from megatron_gspo.preflight.run import PreflightError, run_preflight

    loaded = load_recipe(recipe) if recipe else None  # a bad recipe: the one-line handler

    def written(report: Report, part) -> None:
        # Each part as it ends, and the JSON so far: a later timeout keeps what ran.
        click.echo(Report.part_rows(part))
        if json_out:
            Path(json_out).write_text(json.dumps(report.to_json(), indent=2) + "\n")

    click.echo(Report.TABLE_HEAD)
    try:
        report = run_preflight(size, recipe=loaded, on_part=written)
    except PreflightError as e:
        raise click.ClickException(str(e)) from None
    if json_out:
        Path(json_out).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    click.echo(report.summary())
    sys.exit(report.exit_code())


main.add_command(launch)
main.add_command(plan)


if __name__ == "__main__":
    sys.exit(main())
