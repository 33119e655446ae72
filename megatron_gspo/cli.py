"""The ``megatron-gspo`` command line."""

from __future__ import annotations

import sys
import warnings

import click

from megatron_gspo.config import RecipeError, load_recipe
from megatron_gspo.extras import MissingExtraError, check_recipe_extras
from megatron_gspo.launch import launch
from megatron_gspo.plan import plan


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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
    help="Check the recipe only, not whether this machine has its packages (FP8, vLLM).",
)
def validate(recipe: str, no_extras_check: bool) -> None:
    """Check RECIPE: keys, types, the parallel layout against the model, and needed extras.

    Exit 1: the recipe is invalid. Exit 3: it is valid but needs an extra not installed here
    (a GPU recipe checked on a CPU machine)."""
    from megatron_gspo.model import check_layout

    try:
        r = load_recipe(recipe)
        check_layout(r.model, r.parallel)
    except (RecipeError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if not no_extras_check:
        try:
            check_recipe_extras(r)
        except MissingExtraError as e:
            click.echo(f"{recipe}: recipe ok, but not runnable on this machine: {e}", err=True)
            sys.exit(3)
    click.echo(f"{recipe}: ok")


main.add_command(launch)
main.add_command(plan)


if __name__ == "__main__":
    sys.exit(main())
