"""Extractive summarization (TF-IDF centrality + word frequency) and keyword extraction (TF x spread, phrases)."""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from typing import Final

from oncelery.tasks.llm.text import (
    STOPWORDS,
    content_words,
    fold_plurals,
    normalize,
    sample_without_replacement,
    sentences,
    top_indices,
    words,
)

LEAD_BONUS: Final = 0.1  # news-style prose puts its point first
SHORT_SENTENCE: Final = 6  # words; fragments ("See below.") rarely summarise anything
MAX_PHRASE: Final = 3  # words in a key phrase
SAMPLE_POOL: Final = 3  # with temperature > 0, keywords are drawn from the best SAMPLE_POOL * k candidates
_CLAUSE = re.compile(r"[,;:()\[\]\"\u201c\u201d\u2014\u2013]|\s-\s")


def sentence_scores(sents: list[str]) -> list[float]:
    """Score each sentence by TF-IDF cosine centrality (60%) and mean word frequency (40%), in [0, ~1.1]."""
    raw = [content_words(s) for s in sents]
    fold = fold_plurals([w for toks in raw for w in toks])
    toks = [[fold[w] for w in t] for t in raw]
    n = len(sents)
    df = Counter(w for t in toks for w in set(t))
    tf = Counter(w for t in toks for w in t)
    idf = {w: math.log((1 + n) / (1 + d)) + 1.0 for w, d in df.items()}
    vecs = [{w: c * idf[w] for w, c in Counter(t).items()} for t in toks]
    norms = [math.sqrt(sum(v * v for v in vec.values())) or 1.0 for vec in vecs]
    centrality = [
        sum(
            sum(weight * vecs[j].get(w, 0.0) for w, weight in vecs[i].items()) / (norms[i] * norms[j])
            for j in range(n)
            if j != i
        )
        for i in range(n)
    ]
    frequency = [sum(tf[w] for w in t) / len(t) if t else 0.0 for t in toks]
    scores = []
    for i, (c, f) in enumerate(zip(normalize(centrality), normalize(frequency), strict=True)):
        length = len(words(sents[i]))
        score = 0.6 * c + 0.4 * f
        score *= 0.5 if length < SHORT_SENTENCE else 1.0
        scores.append(score + (LEAD_BONUS if i == 0 else 0.0))
    return scores


def summarize(text: str, *, n_sentences: int, max_words: int, temperature: float, rng: random.Random) -> str:
    """Return up to n_sentences of the text's own sentences (best-scored, or sampled), in their original order.

    Sentences are added best first while the summary stays within max_words; the first pick is always kept.
    """
    sents = sentences(text)
    if not sents:
        return ""
    scores = sentence_scores(sents)
    if temperature > 0:
        order = sample_without_replacement(scores, len(sents), temperature, rng)
    else:
        order = top_indices(scores, len(sents))
    chosen: list[int] = []
    budget = max_words
    for i in order:
        length = len(sents[i].split())
        if chosen and length > budget:
            continue
        chosen.append(i)
        budget -= length
        if len(chosen) == n_sentences:
            break
    return " ".join(sents[i] for i in sorted(chosen))


def _proper_nouns(sents: list[str]) -> set[str]:
    """Words capitalised somewhere other than a sentence start (names, places, products)."""
    found: set[str] = set()
    for s in sents:
        for token in s.split()[1:]:
            bare = token.strip("\"'()[],;:.!?")
            if bare[:1].isupper() and bare[1:].islower() and bare.lower() not in STOPWORDS:
                found.add(bare.lower())
    return found


def keyword_candidates(text: str) -> list[tuple[str, float]]:
    """Rank key words and recurring phrases, best first, with phrases' words not repeated as single keywords.

    A word scores tf x (1 + its spread over sentences), x1.3 for proper nouns; a phrase of up to MAX_PHRASE
    content words that occurs at least twice scores the sum of its words' scores x (its count / their max tf).
    """
    sents = sentences(text)
    runs: list[list[str]] = []
    for s in sents:
        for clause in _CLAUSE.split(s):
            run: list[str] = []
            for w in [*words(clause), ""]:
                if w and len(w) >= 3 and w not in STOPWORDS and not w.endswith("'s"):
                    run.append(w)
                elif run:
                    runs.append(run)
                    run = []
    fold = fold_plurals([w for r in runs for w in r])
    runs = [[fold[w] for w in r] for r in runs]
    tf = Counter(w for r in runs for w in r)
    spread = Counter(w for s in sents for w in {fold.get(x, x) for x in content_words(s)})
    proper = {fold.get(w, w) for w in _proper_nouns(sents)}
    n = max(1, len(sents))
    word_score = {w: c * (1.0 + spread[w] / n) * (1.3 if w in proper else 1.0) for w, c in tf.items()}
    phrases = Counter(
        tuple(r[i : i + size]) for r in runs for size in range(2, MAX_PHRASE + 1) for i in range(len(r) - size + 1)
    )
    scored: dict[tuple[str, ...], float] = {(w,): s for w, s in word_score.items()}
    for phrase, count in phrases.items():
        if count >= 2 and len(set(phrase)) == len(phrase):
            scored[phrase] = sum(word_score[w] for w in phrase) * count / max(tf[w] for w in phrase)
    ranked: list[tuple[tuple[str, ...], float]] = []
    for phrase, score in sorted(scored.items(), key=lambda item: (-item[1], item[0])):
        if any(set(phrase) <= set(kept) for kept, _ in ranked):
            continue  # already said by a better phrase
        ranked.append((phrase, score))
    return [(" ".join(phrase), score) for phrase, score in ranked]


def keywords(text: str, *, k: int, temperature: float, rng: random.Random) -> list[str]:
    """Return the k best keywords (or, with temperature > 0, k drawn from the best SAMPLE_POOL * k)."""
    ranked = keyword_candidates(text)
    if temperature <= 0:
        return [phrase for phrase, _ in ranked[:k]]
    pool = ranked[: SAMPLE_POOL * k]
    picks = sample_without_replacement([score for _, score in pool], k, temperature, rng)
    return [pool[i][0] for i in picks]
