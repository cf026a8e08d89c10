"""Text primitives for the offline model: sentences, paragraphs, words, stopwords, syllables, sampling."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from typing import Final

# Common English function words (and a few generic ones): they carry grammar, not topic, so are never keywords.
_STOPWORD_LIST = """
    a about above after again against all almost also although always am among an and another any anyone
    anything are around as at be became because become becomes been before being below between both but by
    can cannot could did do does doing done down during each either else enough even ever every few for from
    further had has have having he her here hers herself him himself his how however i if in into is it its
    itself just least less like made make makes many may me might more most much must my myself neither never
    no nor not now of off often on once one only onto or other others otherwise our ours ourselves out over
    own per perhaps quite rather really said same say says see seem seemed seems several shall she should
    since so some something sometimes still such than that the their theirs them themselves then there
    therefore these they thing things this those though through thus to together too toward towards two
    under until up upon us use used uses using very via was we well were what whatever when whenever where
    whether which while who whoever whole whom whose why will with within without would yet you your yours
    yourself yourselves indeed mr mrs ms dr st new first last long great little old right
    big high different small large next early young important public bad able get got gets go goes going
    went gone take took taken come came way ways year years time times day days back know knew known
"""
STOPWORDS: Final = frozenset(_STOPWORD_LIST.split())
_ABBREVIATION_LIST = "mr mrs ms dr prof st jr sr vs etc e.g i.e no fig inc ltd co u.s"
_ABBREVIATIONS: Final = frozenset(_ABBREVIATION_LIST.split())
# A sentence ends at . ! ? (and any closing quotes/brackets) before whitespace and a capital or digit.
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]\u201d\u2019]*(?=\s+[\"'(\[\u201c\u2018]?[A-Z0-9])")
_PARAGRAPH = re.compile(r"\n\s*\n")
_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*[A-Za-z]|[A-Za-z]")
_VOWEL_GROUP = re.compile(r"[aeiouy]+")
LOGIT_SCALE: Final = 4.0  # a [0, 1] score becomes a logit in [0, 4]: at temperature 1 the best is ~e^4 likelier


def paragraphs(text: str) -> list[str]:
    """Return the text's non-empty paragraphs (blocks separated by blank lines)."""
    return [p.strip() for p in _PARAGRAPH.split(text.strip()) if p.strip()]


def sentences(text: str) -> list[str]:
    """Return the text's sentences in order, not splitting after common abbreviations (Dr., e.g.)."""
    out: list[str] = []
    for para in paragraphs(text):
        pending = ""
        for piece in _split_ends(" ".join(para.split())):
            pending = f"{pending} {piece}" if pending else piece
            last = pending.rsplit(None, 1)[-1]
            stem = last.rstrip(".").lower()
            if last.endswith(".") and (stem in _ABBREVIATIONS or (len(stem) == 1 and stem.isalpha())):
                continue  # "Dr. Smith", "J. Doe": the period ends an abbreviation, not the sentence
            out.append(pending.strip())
            pending = ""
        if pending.strip():
            out.append(pending.strip())
    return out


def _split_ends(flat: str) -> list[str]:
    pieces: list[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(flat):
        pieces.append(flat[start : match.end()])
        start = match.end()
    pieces.append(flat[start:])
    return [piece.strip() for piece in pieces if piece.strip()]


def words(text: str) -> list[str]:
    """Return the text's words, lowercased (letters, inner apostrophes and hyphens)."""
    return [w.lower() for w in _WORD.findall(text)]


def content_words(text: str) -> list[str]:
    """Return the words that carry topic: not stopwords, at least three letters."""
    return [w for w in words(text) if len(w) >= 3 and w not in STOPWORDS and not w.endswith("'s")]


def fold_plurals(tokens: Sequence[str]) -> dict[str, str]:
    """Map each word to its singular when both forms occur ("models" -> "model"), else to itself."""
    vocab = set(tokens)
    folded: dict[str, str] = {}
    for w in vocab:
        if w.endswith("ies") and w[:-3] + "y" in vocab:
            folded[w] = w[:-3] + "y"
        elif w.endswith("es") and w[:-2] in vocab:
            folded[w] = w[:-2]
        elif w.endswith("s") and not w.endswith("ss") and w[:-1] in vocab:
            folded[w] = w[:-1]
        else:
            folded[w] = w
    return folded


def syllables(word: str) -> int:
    """Estimate a word's syllables: vowel groups, minus a silent final e, at least one."""
    w = word.lower().strip("'")
    count = len(_VOWEL_GROUP.findall(w))
    if w.endswith("e") and not w.endswith(("le", "ee", "ye")) and count > 1:
        count -= 1
    return max(1, count)


def normalize(scores: Sequence[float]) -> list[float]:
    """Scale scores to [0, 1] by the maximum (all zeros stay zeros)."""
    top = max(scores, default=0.0)
    return [s / top if top > 0 else 0.0 for s in scores]


def sample_without_replacement(scores: Sequence[float], k: int, temperature: float, rng: random.Random) -> list[int]:
    """Draw k distinct indices with probability softmax(LOGIT_SCALE * normalized score / temperature)."""
    logits = [LOGIT_SCALE * s / temperature for s in normalize(scores)]
    pool = list(range(len(scores)))
    chosen: list[int] = []
    while pool and len(chosen) < k:
        top = max(logits[i] for i in pool)
        weights = [math.exp(logits[i] - top) for i in pool]
        pick = rng.choices(pool, weights=weights)[0]
        chosen.append(pick)
        pool.remove(pick)
    return chosen


def top_indices(scores: Sequence[float], k: int) -> list[int]:
    """Return the indices of the k best scores, best first (ties: earlier first)."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]
