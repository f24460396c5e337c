"""The ``gaussdp`` command line: a thin layer over library functions.

Each topic registers its commands from its own module (``register(app)``), so that importing the CLI
stays cheap: heavy dependencies are imported inside the commands that need them. Every command runs
inside :func:`_guarded`, which turns exceptions into an error line on stderr and a distinct exit code
(see :mod:`gaussdp.cli._output`).
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

# One module per topic; each defines ``register(app: typer.Typer) -> None``.
_COMMAND_MODULES = (
    "gaussdp.cli.accounting",
    "gaussdp.cli.audit",
    "gaussdp.cli.core",
    "gaussdp.cli.demo",
    "gaussdp.cli.federated",
    "gaussdp.cli.finetune",
    "gaussdp.cli.info",
    "gaussdp.cli.inference",
    "gaussdp.cli.ledger_admin",
    "gaussdp.cli.service",
    "gaussdp.cli.text",
    "gaussdp.cli.torch",
)


def _guarded(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command`` with its exceptions mapped to exit codes: 3 budget refused, 2 bad input, 1 internal."""
    import click

    from gaussdp.cli._output import EXIT_INTERNAL, EXIT_REFUSED, EXIT_USAGE, fail
    from gaussdp.errors import BudgetExhausted, PrivacyError

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException, SystemExit):
            raise
        except BudgetExhausted as exc:
            fail(f"budget refused: {exc}", EXIT_REFUSED)
        except (PrivacyError, FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            fail(str(exc), EXIT_USAGE)
        except Exception as exc:
            fail(f"internal error: {type(exc).__name__}: {exc}", EXIT_INTERNAL)

    return run


def _guard_all(app: Any) -> None:
    for info in app.registered_commands:
        info.callback = _guarded(info.callback)
    for group in app.registered_groups:
        _guard_all(group.typer_instance)


def _version(value: bool) -> None:
    if value:
        import typer

        import gaussdp

        sys.stdout.write(f"gaussdp {gaussdp.__version__}\n")
        raise typer.Exit(0)


def build_app():  # type: ignore[no-untyped-def]
    """The Typer application with every topic's commands registered."""
    import typer

    from gaussdp.cli._output import EXIT_CODES_HELP

    app = typer.Typer(
        name="gaussdp",
        help="The Gaussian mechanism of differential privacy: calibrate, account, sanitize, serve.",
        epilog=EXIT_CODES_HELP,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )

    @app.callback()
    def _root(
        version: bool = typer.Option(
            False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ) -> None:
        """The Gaussian mechanism of differential privacy: calibrate, account, sanitize, serve."""

    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(app)
    _guard_all(app)
    return app


def main() -> None:
    """Entry point of the ``gaussdp`` console script."""
    from gaussdp._extras import missing_modules

    if missing_modules("cli"):
        sys.stderr.write("The gaussdp command line needs the 'cli' extra: pip install 'gaussdp[cli]'\n")
        raise SystemExit(2)
    build_app()()
