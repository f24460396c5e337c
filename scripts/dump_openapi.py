"""Dump the service's OpenAPI document as sorted JSON, with every optional router on (``full``)
or in another configuration (``minimal``: no adapters, no fine-tuning, metrics and text off;
``public``: metrics and the text page without keys).

Run from the repository root: ``PYTHONPATH=src python scripts/dump_openapi.py OUT.json [VARIANT]``.
Two dumps (before and after a refactoring of the service) compare with ``diff``: the routes, their
statuses, schemas and descriptions should differ only where a change meant them to.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def main() -> None:
    from gaussdp.service.app import create_app

    out = Path(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "-" else None
    variant = sys.argv[2] if len(sys.argv) > 2 else "full"
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        adapters = {"a": (rng.normal(size=(2, 8)), rng.normal(size=(4, 2)))}
        options: dict[str, Any] = {
            "full": {"lora_adapters": adapters, "data_dir": f"{tmp}/data", "rate_limit_per_s": 100.0},
            "minimal": {"metrics": "off", "text": "off"},
            "public": {"metrics": "public", "text": "public", "lora_adapters": adapters},
        }[variant]
        app = create_app(f"sqlite:///{tmp}/ledger.db", **options)
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
