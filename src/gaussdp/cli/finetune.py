"""``gaussdp finetune``: DP-LoRA fine-tuning of a local causal LM on a corpus (central DP).

A thin layer over :mod:`gaussdp.finetune`: read the corpus, make the plan and print it (epsilon,
steps, noise multiplier) BEFORE any training, train with a progress bar, save the adapter with its
model card, print the card's path. Exit codes as every ``gaussdp`` command: 2 for bad arguments or
input (nothing is trained or written), 1 for an internal error.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from gaussdp.cli._output import JSON_PRECISION


def register(app: typer.Typer) -> None:
    app.command("finetune")(finetune)
    app.command("tiny-causal-lm")(tiny_causal_lm_command)


class CorpusFormat(StrEnum):
    auto = "auto"
    lines = "lines"
    jsonl = "jsonl"


class FinetuneAccountant(StrEnum):
    pld = "pld"
    rdp = "rdp"


def _plan_lines(plan: Any, config: Any) -> list[str]:
    """The plan for people: epsilon rounded up; a calibrated noise multiplier rounded up and
    re-accounted (typed back with --noise-multiplier it meets the target); inputs as given."""
    from gaussdp._format import format_calibrated, format_exact, format_upper

    if config.target_epsilon is not None:
        from gaussdp.accounting import SubsampledGaussianEvent, accountant

        def meets(s: float) -> bool:
            step = SubsampledGaussianEvent(s, plan.sample_rate)
            eps = accountant(plan.accountant).compose(step, count=plan.steps).epsilon(plan.delta)
            return bool(eps <= config.target_epsilon)

        sigma, _ = format_calibrated(plan.noise_multiplier, meets)
        how = f"calibrated for target epsilon {format_exact(config.target_epsilon)}"
    else:
        sigma, how = format_exact(plan.noise_multiplier), "as given"
    return [
        f"plan: {plan.n_records} records, {plan.epochs} epoch(s) = {plan.steps} steps, Poisson sample "
        f"rate {format_exact(plan.sample_rate)} (expected batch {plan.expected_batch_size:.4g})",
        f"noise multiplier sigma = {sigma} ({how}), clip norm {format_exact(plan.clip_norm)}",
        f"epsilon = {format_upper(plan.epsilon)} at delta = {format_exact(plan.delta)} "
        f"({plan.accountant} accountant, add/remove one record)",
    ]


def finetune(
    corpus: Annotated[Path, typer.Argument(help="UTF-8 text (one record per line) or JSONL with 'text'.")],
    model: Annotated[Path, typer.Option("--model", help="Local Hugging Face causal LM directory.")],
    delta: Annotated[float, typer.Option(help="delta of the guarantee, in (0, 1).")],
    out: Annotated[Path, typer.Option("--out", help="Directory to write the adapter and its card to.")],
    epsilon: Annotated[
        float | None,
        typer.Option("--epsilon", help="Target epsilon of the whole run (calibrates the noise)."),
    ] = None,
    noise_multiplier: Annotated[
        float | None, typer.Option("--noise-multiplier", help="Noise multiplier, instead of --epsilon.")
    ] = None,
    epochs: Annotated[int, typer.Option(help="Expected passes over the records.")] = 1,
    batch_size: Annotated[int, typer.Option(help="Expected (Poisson) batch size.")] = 16,
    lr: Annotated[float, typer.Option("--lr", help="Adam learning rate.")] = 1e-3,
    max_seq_len: Annotated[int, typer.Option(help="Tokens kept per record.")] = 64,
    rank: Annotated[int, typer.Option(help="LoRA rank.")] = 8,
    alpha: Annotated[float, typer.Option(help="LoRA alpha.")] = 16.0,
    target_modules: Annotated[
        str | None,
        typer.Option(help="Comma-separated modules to adapt (default: per model type, e.g. c_attn)."),
    ] = None,
    clip_norm: Annotated[float, typer.Option(help="Per-record gradient clip norm.")] = 1.0,
    accountant: Annotated[
        FinetuneAccountant, typer.Option(help="Accountant (both give upper bounds).")
    ] = FinetuneAccountant.pld,
    corpus_format: Annotated[
        CorpusFormat, typer.Option("--format", help="Corpus format.")
    ] = CorpusFormat.auto,
    local_dp: Annotated[
        Path | None,
        typer.Option(help="JSON file declaring the corpus's per-word local DP (for the model card)."),
    ] = None,
    max_physical_batch_size: Annotated[
        int | None, typer.Option(help="Split each batch into passes of at most this many records.")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Reproducible run: the adapter is NOT private.")] = None,
    json_output: Annotated[
        bool,
        typer.Option(
            "--json", help="Print the plan and result as one JSON document on stdout" + JSON_PRECISION
        ),
    ] = False,
) -> None:
    """Fine-tune LoRA adapters of --model on CORPUS with DP-SGD; write a private peft adapter to --out.

    The plan (epsilon, steps, noise) is printed before training; the adapter directory holds peft's
    adapter_config.json and adapter_model.safetensors, a README.md model card with both privacy
    guarantees, and gaussdp_privacy.json. The training loss shown is computed from the corpus
    without noise (fine for whoever holds the corpus; not part of the release).
    """
    import warnings

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from gaussdp._format import format_exact
    from gaussdp.cli._output import emit_json, make_console
    from gaussdp.errors import InvalidParameter, NotPrivateWarning
    from gaussdp.finetune import (
        FinetuneConfig,
        check_local_dp,
        check_model,
        epsilon_text,
        plan_finetune,
        read_corpus,
        run_finetune,
        save_adapter,
    )

    console = make_console()
    err = make_console(stderr=True)
    _quiet_transformers()
    declared = None
    if local_dp is not None:
        try:
            declared = json.loads(local_dp.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise InvalidParameter(
                f"--local-dp {str(local_dp)!r} is not a readable JSON file: {exc}"
            ) from None
        try:
            declared = check_local_dp(declared)
        except (TypeError, InvalidParameter) as exc:
            raise InvalidParameter(f"--local-dp {str(local_dp)!r}: {exc}") from None
    config = FinetuneConfig(
        lora_rank=rank,
        lora_alpha=alpha,
        target_modules=None
        if not target_modules
        else tuple(m.strip() for m in target_modules.split(",") if m.strip()),
        epochs=epochs,
        batch_size=batch_size,
        learning_rate=lr,
        max_seq_len=max_seq_len,
        clip_norm=clip_norm,
        target_epsilon=epsilon,
        delta=delta,
        noise_multiplier=noise_multiplier,
        accountant=accountant.value,
    )
    records = read_corpus(corpus, format=corpus_format.value)
    check_model(model, config)  # refusals that need no weights, before anything is planned
    plan = plan_finetune(config, n_records=len(records))
    for line in _plan_lines(plan, config):
        (err if json_output else console).print(line)
    if seed is not None:
        err.print("[yellow]warning:[/yellow] --seed fixes sampling and noise: the adapter is NOT private")
    progress = Progress(
        TextColumn("[bold]DP fine-tuning"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps  epsilon {task.fields[eps]}  loss {task.fields[loss]}"),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    )
    with progress, warnings.catch_warnings():
        if seed is not None:
            warnings.simplefilter("ignore", NotPrivateWarning)  # warned once above
        task = progress.add_task("finetune", total=plan.steps, eps="0", loss="-")

        def report(p: Any) -> None:
            progress.update(
                task,
                completed=p.step,
                eps=epsilon_text(p.epsilon_so_far),
                loss="-" if p.loss is None else f"{p.loss:.4f}",
            )

        result = run_finetune(
            model,
            records,
            config,
            plan,
            progress=report,
            seed=seed,
            report_loss=True,  # shown to the user who holds the corpus; not written to the adapter
            max_physical_batch_size=max_physical_batch_size,
        )
    path = save_adapter(result, out, local_dp=declared, corpus_name=corpus.name)
    card = path / "README.md"
    if json_output:
        emit_json(
            {
                "plan": plan.to_dict(),
                "epsilon": result.epsilon,
                "delta": plan.delta,
                "steps": result.steps_done,
                "private": result.private,
                "adapter_dir": str(path),
                "model_card": str(card),
                "trainable_parameters": result.trainable_parameters,
                "tokens": result.tokens,
                "seconds": result.seconds,
                "train_seconds": result.train_seconds,
                "first_loss": result.losses[0] if result.losses else None,
                "last_loss": result.losses[-1] if result.losses else None,
            }
        )
        return
    console.print(
        f"trained {result.trainable_parameters} LoRA parameters for {result.steps_done} steps "
        f"({result.tokens} tokens in {result.train_seconds:.1f} s); epsilon spent "
        f"{epsilon_text(result.epsilon)} at delta={format_exact(plan.delta)}"
    )
    console.print(f"adapter written to {path}; model card: {card}")


def _quiet_transformers() -> None:
    """No download bars or deprecation chatter from transformers on this command's stderr."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def tiny_causal_lm_command(
    out_dir: Annotated[Path, typer.Argument(help="Directory to save the model and tokenizer to.")],
    train: Annotated[
        bool, typer.Option(help="Train it briefly (non-private) on gensim's Lee corpus.")
    ] = False,
) -> None:
    """Save a tiny GPT-2 and tokenizer built from a config (no download) for `gaussdp finetune --model`."""
    from gaussdp.finetune import tiny_causal_lm

    path = tiny_causal_lm(out_dir, train=train)
    typer.echo(f"saved {path}")
