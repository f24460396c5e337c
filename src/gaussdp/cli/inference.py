"""``gaussdp inference-report``: the privacy/utility curve of hidden-state noise, and the demo section."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any

import typer

from gaussdp._neighbouring import DEFAULT_HIDDEN_STATE_NEIGHBOURING, check_neighbouring
from gaussdp.cli._output import JSON_PRECISION
from gaussdp.errors import InvalidParameter


def register(app: typer.Typer) -> None:
    app.command("inference-report")(inference_report)
    app.command("train-tiny-lm")(train_tiny_lm_command)


def train_tiny_lm_command(
    out_dir: Path = typer.Argument(..., help="Directory to save the model and tokenizer to."),
    corpus: str = typer.Option(
        "", help="A UTF-8 text file, one document per line (default: gensim's lee_background.cor)."
    ),
    steps: int = typer.Option(600, help="Training steps (batches of 16 x 64 tokens)."),
    seed: int = typer.Option(0, help="Seed of the initialisation and the batches."),
) -> None:
    """Train a small GPT-2 on real text shipped with gensim (CPU, minutes) for `inference-report --model`."""
    from gaussdp.inference.tiny_lm import train_tiny_lm

    r = train_tiny_lm(out_dir, corpus=corpus or None, steps=steps, seed=seed)
    typer.echo(
        f"saved {r.path}: GPT-2, {r.parameters / 1e6:.2f} M parameters, word vocabulary {r.vocab_size}, "
        f"{r.train_tokens} training tokens; held-out perplexity {r.perplexity_before:.0f} (untrained) -> "
        f"{r.perplexity_after:.1f} on {r.held_out_tokens} tokens, in {r.seconds:.0f} s"
    )


class PrivatizeUnit(StrEnum):
    token = "token"
    sequence = "sequence"


def _floats(name: str, text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"{name} must be a comma-separated list of numbers, got {text!r}") from None
    if not values:
        raise typer.BadParameter(f"{name} is empty")
    return values


def _print_document_000(console: Any, doc: Any) -> None:
    from gaussdp._format import format_upper

    a, m = doc.analytic, doc.measured
    console.print(
        "[bold]The private inference server's setting[/bold]: d=1536, clip C=1, "
        "sigma=4.8448 (classical, epsilon=1, delta=1e-5)"
    )
    console.print(
        f"  noise norm: sigma*sqrt(d) = {a.noise_norm_rms:.1f} (exact mean {a.noise_norm_mean:.1f}, "
        f"measured {m.noise_norm_mean:.1f})"
    )
    console.print(
        f"  true SNR = C / noise norm = {a.snr:.5f} (measured {m.snr:.5f}); "
        f"the document reports {doc.claimed_snr:.2f} by dividing the UNCLIPPED norm 177.5"
    )
    console.print(
        f"  true epsilon per request of that sigma: {format_upper(doc.epsilon_add_remove, 4)} (sensitivity "
        f"C, the document's relation), {format_upper(doc.epsilon_replace, 4)} (replace-one, sensitivity 2C)"
    )
    console.print(
        f"  an SNR of 1 at d=1536 would need epsilon = {format_upper(doc.epsilon_for_snr_1, 4)} per request"
    )


def inference_report(
    epsilons: str = typer.Option("0.5,1,2,4,8,16,64,256", help="Per-token epsilons to sweep."),
    clip_norms: str = typer.Option(
        "auto", help="Comma-separated clip norms, or 'auto' (0.25, 1 and 4 x the median hidden norm)."
    ),
    delta: float = typer.Option(1e-5, help="Per-token delta."),
    model: str = typer.Option(
        "",
        help="Local Hugging Face directory with a causal LM and its tokenizer, e.g. from "
        "`gaussdp train-tiny-lm DIR` (default: an UNTRAINED tiny GPT-2: mechanics only).",
    ),
    layer: str = typer.Option("", help="Module path to hook (default: the last transformer block)."),
    prompts_file: str = typer.Option(
        "",
        "--prompts",
        help="UTF-8 text file, one prompt per line (default: held-out documents of gensim's Lee corpus).",
    ),
    n_prompts: int = typer.Option(8, "--n-prompts", help="Number of prompts used (the first ones)."),
    prompt_len: int = typer.Option(32, help="Tokens per prompt (longer prompts are cut)."),
    per: PrivatizeUnit = typer.Option(PrivatizeUnit.token, help="'token' or 'sequence'."),
    neighbouring: str = typer.Option(
        DEFAULT_HIDDEN_STATE_NEIGHBOURING,
        help="Relation the epsilons are for: 'replace_one' (default everywhere for hidden states, "
        "sensitivity 2C) or 'add_remove' (sensitivity C).",
    ),
    out: str = typer.Option("inference_report.png", help="Where to write the PNG."),
    json_output: bool = typer.Option(
        False,
        "--json",
        help="Print the sweep as one JSON document on stdout, the table on stderr" + JSON_PRECISION,
    ),
) -> None:
    """Sweep epsilon and clip norm, print SNR and next-token effects, draw the privacy/utility PNG."""
    import dataclasses

    from rich.table import Table

    from gaussdp.cli._output import emit_json, make_console

    console = make_console(stderr=json_output)
    reports = run_report(
        console,
        epsilons=_floats("epsilons", epsilons),
        clip_norms=None if clip_norms.strip() == "auto" else _floats("clip_norms", clip_norms),
        delta=delta,
        model_path=model or None,
        layer=layer or None,
        prompts_path=prompts_file or None,
        n_prompts=n_prompts,
        prompt_len=prompt_len,
        per=str(per),
        neighbouring=neighbouring,
        out=Path(out),
        table_cls=Table,
    )
    if json_output:
        emit_json({"delta": delta, "png": out, "points": [dataclasses.asdict(r) for r in reports]})


def run_report(
    console: Any,
    *,
    epsilons: list[float],
    clip_norms: list[float] | None,
    delta: float,
    model_path: str | None,
    layer: str | None,
    n_prompts: int,
    prompt_len: int,
    per: str,
    out: Path,
    table_cls: Any,
    neighbouring: str = DEFAULT_HIDDEN_STATE_NEIGHBOURING,
    prompts_path: str | None = None,
) -> list[Any]:
    try:
        neighbouring = check_neighbouring(neighbouring, "--neighbouring").value
    except InvalidParameter as exc:
        raise typer.BadParameter(str(exc), param_hint="--neighbouring") from exc
    import torch

    from gaussdp.inference.report import document_000, plot_privacy_utility, sweep, tiny_causal_lm

    doc = document_000()
    _print_document_000(console, doc)
    from gaussdp.inference import tiny_lm

    try:
        if prompts_path:
            texts, source = tiny_lm.read_prompts(prompts_path), prompts_path
        else:
            texts = tiny_lm.held_out_split(tiny_lm.corpus_documents())[1]
            source = f"held-out documents of {tiny_lm.default_corpus_path().name} (gensim's test data)"
        loaded = tiny_lm.load_causal_lm(model_path) if model_path else None
    except (InvalidParameter, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc)) from None
    if loaded is not None:
        lm, tokenizer = loaded
    else:
        # No trained model given: random weights with a word tokenizer of the corpus. The prompts
        # are real text, but the model knows nothing: its perplexities illustrate the mechanics.
        tokenizer = tiny_lm.build_tokenizer(tiny_lm.held_out_split(tiny_lm.corpus_documents())[0], 2000)
        lm = tiny_causal_lm(vocab_size=len(tokenizer))
        console.print(
            "[yellow]no --model: an UNTRAINED tiny GPT-2 (random weights); its perplexities mean nothing. "
            "Train one with `gaussdp train-tiny-lm DIR` and pass --model DIR.[/yellow]"
        )
    if isinstance(n_prompts, bool) or n_prompts < 1 or prompt_len < 2:
        raise typer.BadParameter(f"need n_prompts >= 1 and prompt_len >= 2, got {n_prompts}, {prompt_len}")
    prompts = []
    for text in texts[:n_prompts]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:prompt_len]
        if len(ids) < 2:
            raise typer.BadParameter(f"prompt {text[:40]!r} has fewer than 2 tokens", param_hint="--prompts")
        prompts.append(torch.tensor([ids]))
    console.print(f"prompts: {len(prompts)} x <= {prompt_len} tokens of real text from {source}")
    if clip_norms is None:
        # Median hidden norm at the hooked layer, measured without noise (a fixed tiny sigma).
        from gaussdp.inference.diagnostics import utility_report

        probe = utility_report(lm, prompts[:2], clip_norm=1e12, sigma=1.0, layer=layer, per=per)
        med = probe.mean_hidden_norm
        clip_norms = [0.25 * med, med, 4 * med]
    reports = sweep(
        lm,
        prompts,
        epsilons=epsilons,
        clip_norms=clip_norms,
        delta=delta,
        layer=layer,
        per=per,
        neighbouring=neighbouring,
    )
    from rich import box

    from gaussdp._format import format_exact, format_upper

    # epsilon (an upper bound), the sensitivity C and the calibrated sigma rounded up; utility as is
    table = table_cls(
        title=f"hidden-state privatization, {type(lm).__name__}, delta={format_exact(delta)}, {neighbouring}",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
    )
    for col in ("eps/tok", "C", "sigma", "|h|", "clip%", "|noise|", "SNR", "agree", "KL", "ppl->priv"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in reports:
        table.add_row(
            "-" if r.epsilon_per_token is None else format_upper(r.epsilon_per_token, 3),
            format_upper(r.clip_norm, 2),
            format_upper(r.sigma, 2),
            f"{r.mean_hidden_norm:.2g}",
            f"{r.fraction_clipped:.0%}",
            f"{r.mean_noise_norm:.2g}",
            f"{r.snr:.2g}",
            f"{r.agreement:.2f}",
            f"{r.kl:.2g}",
            f"{r.ppl_clean:.3g}->{r.ppl_private:.3g}",
        )
    if console.width < 110:  # the table needs ~110 columns; a pipe reports 80
        from gaussdp.cli._output import make_console

        make_console(width=110, file=console.file).print(table)
    else:
        console.print(table)
    path = plot_privacy_utility(reports, out, doc=doc)
    console.print(f"wrote {path}")
    return reports


def demo(console: Any, out_dir: Path) -> None:
    """Private inference section of ``gaussdp demo``: a session that is refused once its budget is spent."""
    import torch
    from rich.table import Table

    from gaussdp._format import format_upper
    from gaussdp.budget import Budget, Ledger
    from gaussdp.errors import BudgetExhausted
    from gaussdp.inference import HiddenStatePrivatizer
    from gaussdp.inference.report import tiny_causal_lm

    lm = tiny_causal_lm()
    ledger = Ledger("memory://")
    ledger.open("session-1", Budget(8.0, 1e-5))
    prompt = torch.tensor([[5, 17, 42, 8]])
    with HiddenStatePrivatizer(
        lm, clip_norm=1.0, epsilon=1.0, delta=1e-5, ledger=ledger, session_id="session-1"
    ) as priv:
        console.print(
            f"hooked {priv.layer_path}: clip C=1, per-token epsilon=1, delta=1e-5 (replace-one) -> "
            f"sigma={format_upper(priv.sigma, 4)}; session budget epsilon=8 (PLD accountant)"
        )
        for i in range(1, 50):
            try:
                lm(prompt)
            except BudgetExhausted as exc:
                console.print(f"request {i}: refused: {str(exc)[:110]}...")
                break
            s = priv.last_release
            if s is None:
                raise RuntimeError("the privatizer released without recording its release")
            console.print(
                f"request {i}: {s.rows} tokens charged, "
                f"spent epsilon={format_upper(ledger.spent('session-1').epsilon, 4)}; "
                f"|h|={s.mean_norm:.2f}, |noise|={s.mean_noise_norm:.1f}, SNR={s.snr:.4f}"
            )
    # A small model trained on real text (gensim's Lee corpus), so that the perplexities below mean
    # something; the demo's settings train in seconds (`gaussdp train-tiny-lm` trains a larger one).
    from gaussdp.inference.tiny_lm import train_tiny_lm

    lm_dir = out_dir / "tiny-lm"
    if not (lm_dir / "config.json").is_file():
        r = train_tiny_lm(
            lm_dir, vocab_size=2000, n_embd=64, n_layer=2, n_head=2, seq_len=32, batch_size=8,
            steps=300, learning_rate=1e-2,
        )  # fmt: skip
        console.print(
            f"trained {lm_dir}: GPT-2, {r.parameters / 1e6:.2f} M parameters, held-out perplexity "
            f"{r.perplexity_before:.0f} (untrained) -> {r.perplexity_after:.0f}, in {r.seconds:.0f} s"
        )
    run_report(
        console,
        epsilons=[1.0, 8.0, 64.0, 512.0],
        clip_norms=None,
        delta=1e-5,
        model_path=str(lm_dir),
        layer=None,
        n_prompts=3,
        prompt_len=32,
        per="token",
        out=out_dir / "inference_privacy_utility.png",
        table_cls=Table,
    )
