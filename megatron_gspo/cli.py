"""The ``megatron-gspo`` command line."""

from __future__ import annotations

import sys
import warnings

import click

from megatron_gspo.config import RecipeError, load_recipe
from megatron_gspo.extras import MissingExtraError, check_recipe_extras


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="megatron-gspo")
def main() -> None:
    """GSPO reinforcement learning for Mixture-of-Experts models on Megatron-Core."""
    # Megatron warns about apex and fused kernels it falls back from; the fallbacks are the
    # documented CPU path here, so the warnings only bury the run's own output.
    warnings.filterwarnings("ignore", module="megatron.core")


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
def validate(recipe: str) -> None:
    """Check RECIPE: keys, types, the parallel layout against the model, and needed extras."""
    from megatron_gspo.model import check_layout

    try:
        r = load_recipe(recipe)
        check_layout(r.model, r.parallel)
        check_recipe_extras(r)
    except (RecipeError, MissingExtraError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{recipe}: ok")


if __name__ == "__main__":
    sys.exit(main())
