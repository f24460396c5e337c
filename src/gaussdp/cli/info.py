"""``gaussdp info``: versions, extras present, noise back ends active, accountants available."""

from __future__ import annotations

import typer

from gaussdp.cli._output import emit_json, make_console


def register(app: typer.Typer) -> None:
    app.command()(info)


def info(json_output: bool = typer.Option(False, "--json", help="Print one JSON document.")) -> None:
    """What this installation has: versions, extras, noise back ends (C kernel built or not), accountants."""
    from gaussdp._info import environment_info

    data = environment_info()
    if json_output:
        emit_json(data)
        return
    out = make_console()
    out.print(f"gaussdp {data['gaussdp']}  (Python {data['python']}, {data['platform']})")
    versions = ", ".join(f"{k} {v}" for k, v in data["packages"].items() if v is not None)
    out.print(f"packages: {versions}")
    present = [k for k, v in data["extras"].items() if v["installed"]]
    extras = data["extras"].items()
    absent = [f"{k} (missing {', '.join(v['missing'])})" for k, v in extras if not v["installed"]]
    out.print(f"extras installed: {', '.join(present) or 'none'}")
    if absent:
        out.print(f"extras not installed: {'; '.join(absent)}")
    noise = data["noise"]
    out.print(f"noise, core secure: {noise['core_secure_note']}")
    kernel = noise["c_kernel"]
    if kernel["built"]:
        out.print("noise, C kernel (gaussdp._gauss): built")
    else:
        out.print(
            "noise, C kernel (gaussdp._gauss): NOT built; torch DP-SGD noise falls back to torch's "
            "generator (reinstall with a C compiler and glibc's libmvec to build it)"
        )
    out.print(f"noise, torch DP-SGD default: {noise['torch_default_noise']}")
    search = data["text_search_kernel"]
    out.print(
        "text, exact nearest-word search kernel (gaussdp._search): "
        + ("built" if search["built"] else f"NOT built; {search['fallback']}")
    )
    accs = ", ".join(a["name"] + ("" if a["upper_bound"] else " (approximate)") for a in data["accountants"])
    out.print(f"accountants: {accs}")
