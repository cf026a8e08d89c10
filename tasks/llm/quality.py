"""A 0..100 writing-quality score from readability (Flesch reading ease) and structure features."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Final

from oncelery.tasks.llm.text import STOPWORDS, paragraphs, sentences, syllables, words

MATTR_WINDOW: Final = 50  # words; a moving-window type-token ratio does not fall with text length
WORDS_PER_PARAGRAPH: Final = 200  # a longer text in one block is a wall of text
# Feature weights (sum 1): how much each part of "well written" counts.
WEIGHTS: Final = {
    "readability": 0.20,
    "sentence_length": 0.15,
    "variation": 0.10,
    "paragraphs": 0.10,
    "diversity": 0.15,
    "function_words": 0.15,
    "well_formed": 0.15,
}


@dataclass(frozen=True)
class Features:
    """Raw measurements of a text (an empty text measures all zeros)."""

    flesch: float  # Flesch reading ease: ~60-70 plain English, < 30 very hard, > 90 very easy
    mean_sentence_length: float  # words
    sentence_length_cv: float  # standard deviation / mean of sentence lengths: variety of rhythm
    paragraph_ratio: float  # paragraphs / expected paragraphs (one per WORDS_PER_PARAGRAPH words)
    lexical_diversity: float  # MATTR
    function_word_ratio: float  # share of function words; word salad has few
    well_formed_ratio: float  # share of sentences starting with a capital and ending with . ! ?


def peak(x: float, center: float, width: float) -> float:
    """Gaussian bump: 1 at `center`, ~0.61 one `width` away, ~0.14 two widths away."""
    return math.exp(-0.5 * ((x - center) / width) ** 2)


def flesch_reading_ease(n_words: int, n_sentences: int, n_syllables: int) -> float:
    """Return Flesch reading ease: 206.835 - 1.015 words/sentence - 84.6 syllables/word (higher = easier)."""
    return 206.835 - 1.015 * n_words / max(1, n_sentences) - 84.6 * n_syllables / max(1, n_words)


def mattr(tokens: list[str], window: int = MATTR_WINDOW) -> float:
    """Return the moving-average type-token ratio (lexical diversity) over windows of `window` words."""
    if len(tokens) <= window:
        return len(set(tokens)) / max(1, len(tokens))
    ratios = [len(set(tokens[i : i + window])) / window for i in range(len(tokens) - window + 1)]
    return sum(ratios) / len(ratios)


def features(text: str) -> Features:
    """Measure the text's readability and structure."""
    sents = sentences(text)
    tokens = words(text)
    if not sents or not tokens:
        return Features(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    lengths = [len(words(s)) for s in sents]
    mean_len = statistics.fmean(lengths)
    return Features(
        flesch=flesch_reading_ease(len(tokens), len(sents), sum(syllables(w) for w in tokens)),
        mean_sentence_length=mean_len,
        sentence_length_cv=statistics.pstdev(lengths) / mean_len if mean_len else 0.0,
        paragraph_ratio=len(paragraphs(text)) / max(1.0, len(tokens) / WORDS_PER_PARAGRAPH),
        lexical_diversity=mattr(tokens),
        function_word_ratio=sum(w in STOPWORDS for w in tokens) / len(tokens),
        well_formed_ratio=sum(_well_formed(s) for s in sents) / len(sents),
    )


def components(f: Features) -> dict[str, float]:
    """Map each measurement to [0, 1], 1 being typical of clear, well-structured prose."""
    return {
        "readability": peak(f.flesch, 60.0, 25.0),
        "sentence_length": peak(f.mean_sentence_length, 18.0, 8.0),
        "variation": peak(f.sentence_length_cv, 0.5, 0.3) if f.sentence_length_cv > 0 else 0.0,
        "paragraphs": min(1.0, f.paragraph_ratio),
        "diversity": peak(f.lexical_diversity, 0.8, 0.1),
        "function_words": peak(f.function_word_ratio, 0.5, 0.12),
        "well_formed": f.well_formed_ratio,
    }


def quality_score(text: str) -> float:
    """Return the weighted sum of the features, scaled to 0..100 (rounded to 0.1)."""
    measured = features(text)
    if measured.mean_sentence_length == 0:
        return 0.0  # no words: nothing to judge
    parts = components(measured)
    total = sum(weight * parts[name] for name, weight in WEIGHTS.items())
    return round(100.0 * min(1.0, max(0.0, total)), 1)


def _well_formed(sentence: str) -> bool:
    """A sentence that starts with a capital, digit or quote and ends with terminal punctuation."""
    head = sentence.lstrip("\"'(\u201c\u2018")[:1]
    tail = sentence.rstrip("\"')\u201d\u2019")[-1:]
    return (head.isupper() or head.isdigit()) and tail in (".", "!", "?")
