"""Text local DP commands: ``gaussdp perturb-text``, ``gaussdp vocab train|stats``, and the demo section."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from gaussdp.cli._output import JSON_HELP, JSON_PRECISION

_MECHANISM_HELP = (
    "gaussian (word vector plus Gaussian noise, then the nearest word), laplace (multivariate), "
    "mahalanobis, or tem."
)


# Enumerated options (StrEnum members are str: they pass to the library unchanged).
class WordMechanismName(StrEnum):
    gaussian = "gaussian"
    laplace = "laplace"
    mahalanobis = "mahalanobis"
    tem = "tem"


class UnknownPolicy(StrEnum):
    perturb = "perturb"
    sample = "sample"
    drop = "drop"
    error = "error"


class SearchMethod(StrEnum):
    exact = "exact"
    faiss_flat = "faiss-flat"
    faiss_hnsw = "faiss-hnsw"


def register(app: typer.Typer) -> None:
    app.command("perturb-text")(perturb_text_command)
    vocab_app = typer.Typer(help="Word-vector vocabularies for text perturbation.", no_args_is_help=True)
    vocab_app.command("train")(vocab_train)
    vocab_app.command("stats")(vocab_stats)
    app.add_typer(vocab_app, name="vocab")


def _load_vocab(vocab: Path | None) -> Any:
    from gaussdp.text.corpus import shipped_vocabulary
    from gaussdp.text.vocabulary import Vocabulary

    return shipped_vocabulary() if vocab is None else Vocabulary.load(vocab)


def _build_mechanism(
    name: str,
    vocabulary: Any,
    *,
    epsilon: float | None,
    sigma: float | None,
    delta: float,
    distance: float | None,
    seed: int | None,
) -> Any:
    from gaussdp.errors import InvalidParameter
    from gaussdp.text.mechanisms import make_mechanism

    kwargs: dict[str, Any] = {"seed": seed}
    if name == "gaussian":
        kwargs.update(sigma=sigma, epsilon=epsilon, delta=delta, distance=distance)
    else:
        if sigma is not None:
            raise InvalidParameter(f"--sigma applies to the gaussian mechanism only, not {name!r}")
        if epsilon is None:
            raise InvalidParameter(f"--epsilon is required for the {name} mechanism (per unit distance)")
        kwargs["epsilon"] = epsilon
    return make_mechanism(name, vocabulary, **kwargs)


def _print_guarantees(console: Any, result: Any) -> None:
    from rich.table import Table

    from gaussdp._format import format_exact, format_upper

    table = Table(title=f"guarantee ({result.mechanism}, {result.params})")
    table.add_column("what")
    table.add_column("distance", justify="right")
    table.add_column("epsilon", justify="right")
    table.add_column("delta", justify="right")
    table.add_column("rho (zCDP)", justify="right")
    rows = [
        ("one word vs its typical nearest neighbour", result.per_word["nearest_neighbour"]),
        ("one word vs any word (worst case)", result.per_word["worst_case"]),
    ]
    if result.guarantee_neighbour is not None:
        rows.append(
            (
                f"whole text, {result.guarantee_neighbour.words} words, neighbours",
                result.guarantee_neighbour.to_dict(),
            )
        )
        rows.append(
            (
                f"whole text, {result.guarantee_worst.words} words, worst case",
                result.guarantee_worst.to_dict(),
            )
        )
    # rho and epsilon are upper bounds (rounded up), at the distance shown (rounded up: both grow
    # with it) and the delta chosen (as given).
    for label, g in rows:
        rho = "-" if g["rho"] is None else format_upper(g["rho"], 4)
        table.add_row(
            label,
            format_upper(g["distance"], 4),
            format_upper(g["epsilon"], 4),
            format_exact(g["delta"]),
            rho,
        )
    console.print(table)
    console.print(
        f"words: {result.n_words}, unknown: {result.n_unknown}, changed: {result.n_changed} "
        f"({result.fraction_changed:.1%} of known words), mean cosine to original: {result.mean_cosine:.3f}"
    )


def perturb_text_command(
    input_path: Annotated[Path, typer.Argument(metavar="IN.txt", help="UTF-8 text, at most 20 MB.")],
    output_path: Annotated[Path, typer.Argument(metavar="OUT.txt", help="Where the perturbed text goes.")],
    vocab: Annotated[
        Path | None,
        typer.Option(
            help="Vocabulary (.npz of ours, or word2vec .txt/.bin). "
            "Default: the demo vocabulary shipped with gaussdp."
        ),
    ] = None,
    mechanism: Annotated[WordMechanismName, typer.Option(help=_MECHANISM_HELP)] = WordMechanismName.gaussian,
    epsilon: Annotated[
        float | None,
        typer.Option(
            help="gaussian: per-word epsilon at --distance; others: epsilon per unit of distance (metric DP)."
        ),
    ] = None,
    sigma: Annotated[float | None, typer.Option(help="gaussian only: noise standard deviation.")] = None,
    delta: Annotated[float, typer.Option(help="gaussian only: delta of the per-word guarantee.")] = 1e-5,
    distance: Annotated[
        float | None,
        typer.Option(
            help="gaussian + --epsilon: distance the epsilon is calibrated for (default: the "
            "vocabulary's diameter, i.e. local DP between any two words)."
        ),
    ] = None,
    unknown: Annotated[
        UnknownPolicy, typer.Option(help="Out-of-vocabulary words: perturb, sample, drop, error.")
    ] = UnknownPolicy.perturb,
    seed: Annotated[int | None, typer.Option(help="Reproducible noise. NOT private.")] = None,
    search: Annotated[
        SearchMethod,
        typer.Option(help="Nearest-word search: exact (default), faiss-flat, faiss-hnsw (approximate)."),
    ] = SearchMethod.exact,
    report: Annotated[Path | None, typer.Option(help="Also write the statistics as JSON here.")] = None,
    json_output: Annotated[
        bool,
        typer.Option("--json", help="Print the statistics as one JSON document on stdout" + JSON_PRECISION),
    ] = False,
) -> None:
    """Perturb every word of IN.txt (local DP) and write the released words to OUT.txt."""
    import warnings

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from gaussdp.cli._output import make_console
    from gaussdp.errors import NotPrivateWarning, PrivacyError
    from gaussdp.text.perturb import perturb_text
    from gaussdp.text.tokenize import read_text, words

    console = make_console(stderr=True)
    try:
        text = read_text(input_path)
        vocabulary = _load_vocab(vocab)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotPrivateWarning)
            mech = _build_mechanism(
                str(mechanism),
                vocabulary,
                epsilon=epsilon,
                sigma=sigma,
                delta=delta,
                distance=distance,
                seed=seed,
            )
        mech.search = str(search)
        if seed is not None:
            console.print(
                "[yellow]warning:[/yellow] --seed makes the noise reproducible: output is NOT private"
            )
        total = len(words(text))
        with Progress(
            TextColumn("perturbing"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=console,
        ) as progress:
            task = progress.add_task("words", total=total)
            result = perturb_text(
                text, mech, unknown=str(unknown), progress=lambda done: progress.update(task, completed=done)
            )
    except (PrivacyError, TypeError, OSError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    output_path.write_text(result.text + "\n", encoding="utf-8")
    _print_guarantees(console, result)
    if mech.recall is not None:
        console.print(f"{search} search agreed with the exact search on {mech.recall:.1%} of sampled words")
    if report is not None:
        report.write_text(json.dumps(result.summary(), indent=2), encoding="utf-8")
    console.print(f"wrote {output_path}")
    if json_output:
        from gaussdp.cli._output import emit_json

        emit_json(result.summary())


def vocab_train(
    corpus: Annotated[
        Path, typer.Argument(metavar="CORPUS.txt", help="UTF-8 public text, one sentence per line.")
    ],
    output: Annotated[Path, typer.Argument(metavar="VOCAB", help="Output .npz.")],
    dim: Annotated[int, typer.Option(help="Vector dimension (text perturbation: 50).")] = 50,
    min_count: Annotated[int, typer.Option(help="Drop words seen fewer times.")] = 3,
    window: int = 5,
    negative: int = 8,
    epochs: int = 5,
    max_vocab: int = 100_000,
    subwords: Annotated[
        bool,
        typer.Option(
            help="Train fastText with character n-grams and keep the n-gram table, so that unknown "
            "words get a vector (in Python and in the /text page)."
        ),
    ] = False,
    buckets: Annotated[int, typer.Option(help="n-gram buckets with --subwords (float16 each).")] = 8192,
) -> None:
    """Train word2vec (gensim) on CORPUS.txt, clip vectors to [-1, 1], save as our .npz format."""
    from gaussdp.cli._output import make_console
    from gaussdp.errors import PrivacyError
    from gaussdp.text.vocabulary import Vocabulary

    console = make_console()
    try:
        vocabulary = Vocabulary.train(
            corpus,
            dim=dim,
            min_count=min_count,
            window=window,
            negative=negative,
            epochs=epochs,
            max_vocab=max_vocab,
            subwords=subwords,
            buckets=buckets,
        )
    except (PrivacyError, OSError) as exc:
        make_console(stderr=True).print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    path = vocabulary.save(output)
    console.print(f"{vocabulary} written to {path}")


def vocab_stats(
    vocab: Annotated[Path, typer.Argument(metavar="VOCAB", help="A vocabulary file.")],
    sigma: Annotated[float, typer.Option(help="Gaussian sigma to report the per-word guarantee for.")] = 0.1,
    delta: float = 1e-5,
    json_output: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Size, distances, and what a Gaussian sigma means for words of this vocabulary."""
    from gaussdp._format import format_exact, format_upper
    from gaussdp.cli._output import make_console
    from gaussdp.text.mechanisms import GaussianWordMechanism
    from gaussdp.text.vocabulary import Vocabulary

    console = make_console()
    vocabulary = Vocabulary.load(vocab)
    d_nn = vocabulary.nearest_neighbour_distance()
    mech = GaussianWordMechanism(vocabulary, sigma=sigma, delta=delta)
    distances = (
        ("nearest neighbour", d_nn),
        ("vocabulary diameter", vocabulary.diameter_bound),
        ("box diagonal", vocabulary.box_diameter),
    )
    if json_output:
        from gaussdp.cli._output import emit_json

        emit_json(
            {
                "words": len(vocabulary),
                "dim": vocabulary.dim,
                "source": vocabulary.meta.get("source", ""),
                "nearest_neighbour_distance": d_nn,
                "diameter_bound": vocabulary.diameter_bound,
                "box_diameter": vocabulary.box_diameter,
                "sigma": sigma,
                "delta": delta,
                "guarantees": [
                    {"distance_of": label, "distance": d, **_guarantee(mech.word_guarantee(d))}
                    for label, d in distances
                ],
            }
        )
        return
    console.print(f"{vocabulary}; {vocabulary.meta.get('source', '')}")
    console.print(f"median nearest-neighbour distance: {d_nn:.4g}")
    console.print(
        f"diameter bound: {format_upper(vocabulary.diameter_bound, 4)} (box diagonal 2*sqrt(dim) = "
        f"{format_upper(vocabulary.box_diameter, 4)})"
    )
    for label, d in distances:
        g = mech.word_guarantee(d)
        console.print(
            f"sigma={format_exact(sigma)}, {label} (d={format_upper(d, 4)}): rho={format_upper(g.rho, 4)}, "
            f"epsilon={format_upper(g.epsilon, 4)} at delta={format_exact(delta)}"
        )


def _guarantee(g: Any) -> dict[str, Any]:
    return {"rho": g.rho, "epsilon": g.epsilon}


def demo(console: Any, out_dir: Path) -> None:
    """Text local DP section of ``gaussdp demo``: perturb a paragraph, print the statistics."""
    from gaussdp._format import format_upper
    from gaussdp.calibration import epsilon_for
    from gaussdp.text.corpus import DEMO_PARAGRAPH, shipped_vocabulary
    from gaussdp.text.mechanisms import GaussianWordMechanism, TruncatedExponentialWordMechanism
    from gaussdp.text.perturb import perturb_text, plausible_deniability

    vocabulary = shipped_vocabulary()
    console.print(f"{vocabulary}: {vocabulary.meta.get('source', '')}")
    console.print(
        "the often-claimed epsilon ~96.9 per word for sigma=0.1 is wrong; exact epsilon at its own "
        f"sensitivity 2: {format_upper(epsilon_for(sigma=0.1, delta=1e-5, sensitivity=2.0), 3)}, at the true "
        f"worst case 2*sqrt(50): "
        f"{format_upper(epsilon_for(sigma=0.1, delta=1e-5, sensitivity=vocabulary.box_diameter), 4)}"
    )
    console.print("[bold]input:[/bold]\n" + DEMO_PARAGRAPH)
    for mech in (
        GaussianWordMechanism(vocabulary, sigma=0.1),
        GaussianWordMechanism(vocabulary, sigma=0.5),
        TruncatedExponentialWordMechanism(vocabulary, epsilon=20.0),
    ):
        result = perturb_text(DEMO_PARAGRAPH, mech)
        console.print(f"[bold]{mech.name} {mech.params()}:[/bold]\n{result.text}")
        _print_guarantees(console, result)
        pd = plausible_deniability(mech, ["dog", "london"], samples=500)
        console.print(
            "plausible deniability (500 samples): "
            + ", ".join(f"{w}: N_w={s['N_w']:.2f} S_w={int(s['S_w'])}" for w, s in pd.items())
        )
    (out_dir / "text_perturbed.txt").write_text(result.text + "\n", encoding="utf-8")
