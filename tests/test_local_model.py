"""LocalModel, the offline default: real extractive summaries, keywords, quality scores; seeded sampling."""

from __future__ import annotations

import random

import pytest

from oncelery.tasks.llm import LLMClient, LLMMalformedReply, LocalModel, UnsupportedTask, parse_keywords, parse_quality
from oncelery.tasks.llm.quality import quality_score
from oncelery.tasks.llm.text import STOPWORDS, content_words, sentences

PROSE = """\
Lighthouses were once the most important safety system on the coast. Before satellite navigation, a ship \
approaching land at night had only charts, a compass and the lights on shore to judge its position. Each \
lighthouse had its own pattern of flashes, so a navigator who counted the seconds between them could tell one \
light from another.

The first lighthouses burned wood or coal in open fires. These fires were hard to see in rain and fog, and they \
consumed enormous amounts of fuel. Oil lamps with polished reflectors replaced them in the eighteenth century. \
The real breakthrough came in 1822, when Augustin Fresnel designed a lens made of concentric rings of glass. A \
Fresnel lens bent the light of a single lamp into a narrow, powerful beam that could be seen more than twenty \
miles away.

Keeping the light burning was the work of the lighthouse keeper. Keepers trimmed wicks, polished the lens, wound \
the clockwork that turned it, and wrote the weather in a logbook every few hours. Many keepers lived with their \
families on remote rocks, where supply boats might not arrive for weeks during a storm. The job was lonely, and \
it demanded patience and discipline.

Electricity changed the lighthouse again. Electric lamps were brighter and needed far less attention than oil. \
By the late twentieth century, most lighthouses had been automated, and the last keepers left their stations. \
Today, many old lighthouses serve as museums, while the navigation lights themselves run on solar panels and \
report faults by radio.

Even so, the lighthouse remains a powerful symbol. Sailors still use the lights as a backup when electronic \
systems fail. Historians value the keepers' logbooks as records of weather and shipping. And for many coastal \
towns, the lighthouse on the headland is the image that defines the place.
"""


@pytest.fixture
def model() -> LocalModel:
    """The offline model with its defaults (3 summary sentences, 8 keywords)."""
    return LocalModel()


def test_summary_is_the_texts_own_best_sentences_in_order(model: LocalModel) -> None:
    original = sentences(PROSE)
    summary = model.complete("summarize", PROSE).text
    picked = sentences(summary)

    assert 1 <= len(picked) <= 3
    assert all(s in original for s in picked)
    assert [original.index(s) for s in picked] == sorted(original.index(s) for s in picked)
    assert picked[0] == original[0]  # the lead states the topic here
    assert len(summary.split()) < len(PROSE.split()) / 3


def test_summary_respects_the_word_budget_but_keeps_one_sentence(model: LocalModel) -> None:
    short = model.complete("summarize", PROSE, max_tokens=25).text
    assert len(short.split()) <= 25 and sentences(short)[0] in sentences(PROSE)
    tiny = model.complete("summarize", PROSE, max_tokens=1).text
    assert len(sentences(tiny)) == 1 and tiny in sentences(PROSE)


def test_keywords_are_meaningful_words_of_the_text(model: LocalModel) -> None:
    reply = model.complete("keywords", PROSE).text
    keywords = parse_keywords(reply)

    assert len(keywords) == 8 and reply == ", ".join(keywords)
    words = [w for phrase in keywords for w in phrase.split()]
    assert not [w for w in words if w in STOPWORDS or len(w) < 3]
    assert all(w in PROSE.lower() for w in words)
    assert {"lighthouse", "keeper", "lens"} <= set(words)


def test_quality_is_a_number_in_range_and_prose_beats_word_salad(model: LocalModel) -> None:
    salad_words = content_words(PROSE)
    random.Random(0).shuffle(salad_words)
    salad = " ".join(salad_words)
    shuffled_tokens = PROSE.split()
    random.Random(1).shuffle(shuffled_tokens)

    prose = parse_quality(model.complete("quality", PROSE).text)
    scores = [prose, quality_score(salad), quality_score(" ".join(shuffled_tokens)), quality_score("")]
    assert all(0.0 <= s <= 100.0 for s in scores)
    assert prose >= 70.0
    assert prose - quality_score(salad) >= 40.0
    assert prose - quality_score(" ".join(shuffled_tokens)) >= 30.0
    assert quality_score("") == 0.0


def test_temperature_zero_is_deterministic_and_ignores_the_seed(model: LocalModel) -> None:
    for task in ("summarize", "keywords", "quality"):
        answers = {model.complete(task, PROSE, seed=seed).text for seed in (None, 1, 2)}
        assert len(answers) == 1, task
        assert LocalModel().complete(task, PROSE).text in answers


@pytest.mark.parametrize("task", ["summarize", "keywords", "quality"])
def test_sampling_same_seed_same_answer_other_seed_other_answer(model: LocalModel, task: str) -> None:
    first = model.complete(task, PROSE, temperature=0.8, seed=11).text
    assert model.complete(task, PROSE, temperature=0.8, seed=11).text == first
    assert LocalModel().complete(task, PROSE, temperature=0.8, seed=11).text == first
    assert model.complete(task, PROSE, temperature=0.8, seed=12).text != first
    answers = {model.complete(task, PROSE, temperature=0.8, seed=seed).text for seed in range(10)}
    assert len(answers) >= 5  # an un-guarded retry with another seed visibly differs


def test_sampled_answers_stay_well_formed(model: LocalModel) -> None:
    original = sentences(PROSE)
    for seed in range(5):
        summary = model.complete("summarize", PROSE, temperature=1.0, seed=seed).text
        assert all(s in original for s in sentences(summary))
        keywords = parse_keywords(model.complete("keywords", PROSE, temperature=1.0, seed=seed).text)
        assert len(keywords) == 8 and not set(keywords) & STOPWORDS
        assert 0.0 <= parse_quality(model.complete("quality", PROSE, temperature=1.0, seed=seed).text) <= 100.0


def test_result_counts_words_as_tokens_and_names_the_model(model: LocalModel) -> None:
    result = model.complete("summarize", PROSE)
    assert isinstance(model, LLMClient)
    assert (result.model, result.model_version) == ("local-extractive", "1")
    assert result.input_tokens == len(PROSE.split())
    assert result.output_tokens == len(result.text.split())
    assert result.latency_ms >= 0.0


def test_prompt_hash_identifies_task_text_and_parameters(model: LocalModel) -> None:
    h = model.prompt_hash("summarize", PROSE)
    assert h == LocalModel().prompt_hash("summarize", PROSE) and len(h) == 64
    assert h != model.prompt_hash("keywords", PROSE)
    assert h != model.prompt_hash("summarize", PROSE + "\n")
    assert h != LocalModel(summary_sentences=2).prompt_hash("summarize", PROSE)
    with pytest.raises(UnsupportedTask):
        model.complete("translate", PROSE)


def test_sentence_splitter_keeps_abbreviations_and_quotes_whole() -> None:
    text = 'Dr. Smith met J. R. Doe at 9 a.m. on Monday. "It works!" she said. Prices rose, e.g. bread. Done?'
    assert sentences(text) == [
        "Dr. Smith met J. R. Doe at 9 a.m. on Monday.",
        '"It works!" she said.',
        "Prices rose, e.g. bread.",
        "Done?",
    ]


def test_reply_parsers() -> None:
    assert parse_keywords("1. Lighthouse\n2. Fresnel lens, keeper; keeper") == ["lighthouse", "fresnel lens", "keeper"]
    assert parse_quality("Score: 72.5/100") == 72.5
    with pytest.raises(LLMMalformedReply):
        parse_quality("excellent")
    with pytest.raises(LLMMalformedReply):
        parse_quality("140")
