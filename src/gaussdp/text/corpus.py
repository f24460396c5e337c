"""A small synthetic English corpus, written for gaussdp, to train a demo vocabulary offline.

No download happens at run time: :func:`demo_corpus` generates sentences from a few hundred words
grouped by topic (animals, food, places, weather, family, work, ...) with simple templates, so that
word2vec learns vectors in which words of one topic are close. :func:`demo_vocabulary` trains
the text perturbation service's skip-gram (50 dimensions, min count 3, window 5, 8 negative samples, clipped
to [-1, 1]) on it in a few seconds, as fastText with character n-grams so that unknown words get a
vector. The package also ships the result
(``gaussdp/data/text_vocab_demo.npz``, see :func:`shipped_vocabulary`).

The generator's random seed only chooses which sentences are written: the corpus is public text,
not noise.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np

from gaussdp.text.vocabulary import Vocabulary

__all__ = ["DEMO_PARAGRAPH", "TOPICS", "demo_corpus", "demo_vocabulary", "shipped_vocabulary"]

TOPICS: dict[str, dict[str, list[str]]] = {
    "animals": {
        "noun": "dog cat horse cow sheep goat pig rabbit fox wolf bear deer mouse owl duck goose hen "
        "eagle hawk crow frog snake fish whale".split(),
        "verb": "ran jumped slept barked hunted grazed hid swam flew howled chased ate".split(),
        "adj": "wild tame small furry hungry young old quick sleepy brown".split(),
        "place": "forest field farm barn meadow river pond woods hill valley".split(),
    },
    "food": {
        "noun": "bread cheese apple pear soup rice bean potato carrot onion cake pie milk butter egg "
        "tomato lemon honey salt sugar tea coffee".split(),
        "verb": "cooked baked sliced tasted served boiled fried mixed ate bought".split(),
        "adj": "fresh warm sweet sour salty ripe hot cold tasty crisp".split(),
        "place": "kitchen market bakery table oven shop cafe garden".split(),
    },
    "weather": {
        "noun": "rain snow wind storm cloud sun fog frost thunder lightning ice sky".split(),
        "verb": "fell blew rose cleared poured melted froze thundered shone drifted".split(),
        "adj": "heavy light dark grey bright cold warm wet dry strong".split(),
        "place": "coast mountain city north south harbour island plain".split(),
    },
    "family": {
        "noun": "mother father sister brother aunt uncle cousin grandmother grandfather baby son "
        "daughter wife husband friend neighbour".split(),
        "verb": "visited hugged called married thanked helped met loved missed welcomed".split(),
        "adj": "kind proud happy tired gentle busy loving patient cheerful quiet".split(),
        "place": "home house wedding party church village holiday birthday".split(),
    },
    "work": {
        "noun": "manager engineer doctor nurse teacher lawyer clerk worker student office report "
        "meeting contract salary project budget deadline client".split(),
        "verb": "signed wrote reviewed approved planned hired paid finished delayed discussed".split(),
        "adj": "urgent annual final new senior junior formal careful difficult important".split(),
        "place": "company bank hospital school court factory firm university".split(),
    },
    "travel": {
        "noun": "train bus car ship plane ticket road station airport bridge map bag passport "
        "journey trip hotel".split(),
        "verb": "travelled drove flew sailed arrived left crossed booked missed waited".split(),
        "adj": "long short late early crowded empty slow fast cheap expensive".split(),
        "place": "london paris berlin rome madrid vienna lisbon dublin".split(),
    },
    "music": {
        "noun": "song piano guitar violin drum singer band concert choir melody note dance".split(),
        "verb": "played sang practised danced listened tuned performed composed clapped hummed".split(),
        "adj": "loud soft beautiful sad joyful famous modern classical lively slow".split(),
        "place": "hall stage theatre studio club festival radio opera".split(),
    },
}

_FUNCTION = "the a an his her their our my this that every some one two three".split()
_TEMPLATES = (
    "{det} {adj} {noun} {verb} in the {place}",
    "{det} {noun} {verb} near the {adj} {noun2}",
    "in the {place} {det} {noun} and {det2} {noun2} {verb}",
    "{det} {adj} {noun} {verb} with {det2} {adj2} {noun2}",
    "after the {noun} {verb} {det} {noun2} went to the {place}",
    "we saw {det} {adj} {noun} at the {place} and {det2} {noun2} {verb}",
    "{det} {noun} was {adj} because {det2} {noun2} {verb}",
)

DEMO_PARAGRAPH = (
    "My grandmother baked a warm apple pie in the kitchen, and the hungry dog slept near the oven.\n"
    "After the storm, the cold wind blew over the harbour and the rain fell on the bridge.\n"
    "The senior engineer signed the final contract at the bank before the urgent meeting.\n"
    "We travelled by train to Vienna, where a famous singer performed a beautiful song."
)


def demo_corpus(n_sentences: int = 40_000, *, seed: int = 0) -> list[list[str]]:
    """Generated sentences (token lists) of the demo corpus; deterministic for a given ``seed``."""
    rng = np.random.default_rng(seed)
    names = list(TOPICS)
    out: list[list[str]] = []
    for _ in range(int(n_sentences)):
        topic = TOPICS[names[int(rng.integers(len(names)))]]
        template = _TEMPLATES[int(rng.integers(len(_TEMPLATES)))]

        def pick(kind: str, topic: dict[str, list[str]] = topic) -> str:
            words = topic[kind]
            return words[int(rng.integers(len(words)))]

        sentence = template.format(
            det=_FUNCTION[int(rng.integers(len(_FUNCTION)))],
            det2=_FUNCTION[int(rng.integers(len(_FUNCTION)))],
            adj=pick("adj"),
            adj2=pick("adj"),
            noun=pick("noun"),
            noun2=pick("noun"),
            verb=pick("verb"),
            place=pick("place"),
        )
        out.append(sentence.split())
    return out


def demo_vocabulary(
    *, n_sentences: int = 40_000, epochs: int = 5, seed: int = 0, buckets: int = 4096
) -> Vocabulary:
    """Train the text perturbation service's skip-gram vectors on :func:`demo_corpus` (seconds, one worker).

    fastText (gensim) with character n-grams of 3 to 6 characters hashed into ``buckets`` vectors,
    so that words outside the vocabulary get a vector (:mod:`gaussdp.text.subwords`); ``buckets=0``
    trains plain word2vec (unknown words then start from the zero vector).
    """
    vocab = Vocabulary.train(
        demo_corpus(n_sentences, seed=seed),
        epochs=epochs,
        seed=seed + 1,
        subwords=buckets > 0,
        buckets=max(buckets, 1),
    )
    kind = "fastText (subwords)" if buckets > 0 else "word2vec"
    vocab.meta["source"] = f"{kind} on gaussdp's synthetic demo corpus ({n_sentences} sentences)"
    return vocab


def shipped_vocabulary() -> Vocabulary:
    """The demo vocabulary that ships with the package (built by :func:`demo_vocabulary`)."""
    ref = resources.files("gaussdp") / "data" / "text_vocab_demo.npz"
    with resources.as_file(ref) as path:
        return Vocabulary.load(Path(path))
