"""The ``gaussdp`` command line: a thin layer over library functions.

Each topic registers its commands from its own module (``register(app)``), so that importing the CLI
stays cheap: heavy dependencies are imported inside the commands that need them.
"""

from __future__ import annotations

import importlib
import sys

# One module per topic; each defines ``register(app: typer.Typer) -> None``.
_COMMAND_MODULES = (
    "gaussdp.cli.accounting",
    "gaussdp.cli.audit",
    "gaussdp.cli.core",
    "gaussdp.cli.demo",
    "gaussdp.cli.federated",
    "gaussdp.cli.info",
    "gaussdp.cli.inference",
    "gaussdp.cli.service",
    "gaussdp.cli.text",
    "gaussdp.cli.torch",
)


def build_app():  # type: ignore[no-untyped-def]
    """The Typer application with every topic's commands registered."""
    import typer

    app = typer.Typer(
        name="gaussdp",
        help="The Gaussian mechanism of differential privacy: calibrate, account, sanitize, serve.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(app)
    return app


def main() -> None:
    """Entry point of the ``gaussdp`` console script."""
    from gaussdp._extras import missing_modules

    if missing_modules("cli"):
        sys.stderr.write("The gaussdp command line needs the 'cli' extra: pip install 'gaussdp[cli]'\n")
        raise SystemExit(2)
    build_app()()
