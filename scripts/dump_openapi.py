"""Dump the service's OpenAPI document with every optional router on, as sorted JSON.

Run from the repository root: ``PYTHONPATH=src python scripts/dump_openapi.py OUT.json``. Two dumps
(before and after a refactoring of the service) compare with ``diff``: the routes, their statuses,
schemas and descriptions should differ only where a change meant them to.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np


def main() -> None:
    from gaussdp.service.app import create_app

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        adapters = {"a": (rng.normal(size=(2, 8)), rng.normal(size=(4, 2)))}
        app = create_app(
            f"sqlite:///{tmp}/ledger.db",
            lora_adapters=adapters,
            data_dir=f"{tmp}/data",
            rate_limit_per_s=100.0,
        )
        text = json.dumps(app.openapi(), indent=1, sort_keys=True) + "\n"
        app.state.ledger.close()
        jobs = getattr(app.state, "jobs", None)
        if jobs is not None:
            jobs.close()
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)


if __name__ == "__main__":
    main()
