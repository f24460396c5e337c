"""What every ``gaussdp`` command shares: consoles that do not wrap piped output, JSON output, exit codes.

Exit codes (also in ``gaussdp --help``):

* 0: success;
* 1: internal error (a bug, or a failure outside the user's arguments, such as a full disk);
* 2: bad arguments or input (unknown option value, out-of-range parameter, missing or unsafe file);
* 3: refused by the privacy budget (the ledger would exceed a principal's budget).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, NoReturn

import typer
from rich.console import Console

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3

# Every --json option says so: machine-readable output keeps the floats (their shortest round-trip
# repr), while text output rounds each privacy number the safe way (gaussdp._format).
JSON_PRECISION = " (numbers at full precision; text output rounds privacy numbers the safe way)."
JSON_HELP = "Print one JSON document on stdout" + JSON_PRECISION

PIPE_WIDTH = 4096  # columns of a console writing to a pipe or file: wide enough that nothing wraps
RULE_WIDTH = 100  # a section rule off a terminal: a line of this many columns, not PIPE_WIDTH

EXIT_CODES_HELP = (
    "Exit codes: 0 success; 1 internal error; 2 bad arguments or input; 3 refused by the privacy budget. "
    "Errors go to stderr; --json output goes to stdout."
)


class _PipeConsole(Console):
    """Off a terminal: section rules keep a readable width while text and tables never wrap."""

    def rule(self, *args: Any, **kwargs: Any) -> None:
        from rich.rule import Rule

        self.print(Rule(*args, **kwargs), width=RULE_WIDTH)


def make_console(**options: Any) -> Console:
    """A rich ``Console(**options)`` that wraps only on a terminal: piped output keeps each line whole.

    Off a terminal, text is not wrapped (``soft_wrap``) and tables get room to lay out each row on one
    line (a wide console; a table still takes only the width it needs), unless ``width`` is given.
    """
    options.setdefault("highlight", False)
    out = Console(**options)
    if not out.is_terminal and "width" not in options:
        out = _PipeConsole(**options)
    if not out.is_terminal:
        out.soft_wrap = True
        if "width" not in options:
            out.width = PIPE_WIDTH
    return out


def _plain(value: Any) -> Any:
    # JSON has no inf or nan: write them as the strings "inf", "-inf", "nan" (json.loads-safe everywhere).
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _plain(value.item())
    return value


def emit_json(data: Any) -> None:
    """Write ``data`` to stdout as one JSON document (non-finite floats as strings)."""
    sys.stdout.write(json.dumps(_plain(data), indent=2, allow_nan=False) + "\n")
    sys.stdout.flush()


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code``."""
    make_console(stderr=True).print(f"[red]error:[/red] {message}")
    raise typer.Exit(code)
