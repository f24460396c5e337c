"""``gaussdp demo``: the main job a new user runs first (``make demo``).

Each topic contributes one section, a function ``demo(console, out_dir)`` in its own module, listed
in ``_SECTIONS`` in the order a reader should see them.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import typer

_SECTIONS = (
    ("The Gaussian mechanism", "gaussdp.cli.core:demo"),
    ("Sanitizing embeddings", "gaussdp.cli.core:demo_sanitize"),
    ("Accounting", "gaussdp.cli.accounting:demo"),
    ("Text local DP", "gaussdp.cli.text:demo"),
    ("Private inference", "gaussdp.cli.inference:demo"),
    ("DP-SGD", "gaussdp.cli.torch:demo"),
    ("Federated learning", "gaussdp.cli.federated:demo"),
    ("The privacy ledger and service", "gaussdp.cli.service:demo"),
)


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        out_dir: Path = typer.Option(Path("demo_out"), help="Where the demo writes its files."),
        only: str = typer.Option("", help="Run only sections whose title contains this text."),
    ) -> None:
        """Run the tour of gaussdp: every section prints what it did and the true epsilon spent."""
        from gaussdp.cli._output import make_console

        console = make_console()
        out_dir.mkdir(parents=True, exist_ok=True)
        for title, target in _SECTIONS:
            if only and only.lower() not in title.lower():
                continue
            console.rule(f"[bold]{title}")
            module_name, func_name = target.split(":")
            getattr(importlib.import_module(module_name), func_name)(console, out_dir)
        console.rule("[bold]done")
        console.print(f"Files written under {out_dir}/")
