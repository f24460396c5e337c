"""Fault injection for the Ray tests, importable by the cluster's workers (tests/tables is on their path).

``CrashOnce`` is passed as ``sanitize_dataset(_fault=...)``: at the given stage of the given block's
first attempt it records what it saw in a marker file and kills its worker process with
``os._exit`` (no cleanup, no exception: Ray sees a dead worker and retries the task).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


class CrashOnce:
    def __init__(self, marker_dir: str, out_dir: str, plan: dict[int, str]) -> None:
        self.marker_dir = marker_dir
        self.out_dir = out_dir
        self.plan = plan

    def __call__(self, index: int, stage: str) -> None:
        if self.plan.get(index) != stage:
            return
        marker = Path(self.marker_dir) / f"crashed-{index}.json"
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # a retry: run through
        seen: dict[str, object] = {"index": index, "stage": stage, "pid": os.getpid()}
        if stage == "committed":
            from gaussdp.tables._ray import part_name

            data = (Path(self.out_dir) / part_name(index)).read_bytes()
            seen["sha256"] = hashlib.sha256(data).hexdigest()
        os.write(fd, json.dumps(seen).encode())
        os.fsync(fd)
        os.close(fd)
        os._exit(1)
