"""Read articles from a JSON Lines file, all or nothing: a bad line is an error naming its line number."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import as_file, files
from pathlib import Path
from typing import Any

from oncelery import OnceleryError


class ArticleFileError(OnceleryError):
    """Raised when an articles file cannot be read or a line is not a valid article."""


@dataclass(frozen=True)
class Article:
    """One article version to score: `id` and `version` make its idempotency key."""

    id: str
    version: int
    text: str
    title: str | None = None
    line: int = 0


# The sample articles shipped in the package (the repository's samples/articles.jsonl links to this file).
SAMPLE = ("oncelery.tasks", "samples/articles.jsonl")


def load_sample() -> list[Article]:
    """Return the packaged sample articles (`oncelery process --sample`), from a clone or a pip install alike."""
    package, name = SAMPLE
    with as_file(files(package).joinpath(name)) as path:
        return load_articles(path)


def load_articles(path: Path) -> list[Article]:
    """Return every article of `path` (one JSON object a line; blank lines skipped), or raise on the first bad line.

    Each object needs "id" (non-empty string), "version" (integer >= 0) and "text" (non-empty string);
    "title" is optional and other fields are ignored. An (id, version) may appear once: a second copy
    with another text would be refused by the claim as a conflict, so it is refused here, before sending.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ArticleFileError(f"cannot read {path}: {exc.strerror or exc}") from exc
    articles: list[Article] = []
    seen: dict[tuple[str, int], int] = {}
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        article = _parse(path, number, line)
        first = seen.setdefault((article.id, article.version), number)
        if first != number:
            raise ArticleFileError(
                f"{path} line {number}: article {article.id!r} version {article.version} already appears on "
                f"line {first}; give the new text a new version"
            )
        articles.append(article)
    if not articles:
        raise ArticleFileError(f"{path} has no articles (expected one JSON object per line)")
    return articles


def _parse(path: Path, number: int, line: bytes) -> Article:
    where = f"{path} line {number}"
    try:
        obj: Any = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ArticleFileError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise ArticleFileError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(obj, dict):
        raise ArticleFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [name for name in ("id", "version", "text") if name not in obj]
    if missing:
        raise ArticleFileError(f"{where}: missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    article_id, version, text, title = obj["id"], obj["version"], obj["text"], obj.get("title")
    if not isinstance(article_id, str) or not article_id.strip():
        raise ArticleFileError(f"{where}: 'id' must be a non-empty string, got {article_id!r}")
    # bool is an int subclass in Python; true/false is not a version.
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ArticleFileError(f"{where}: 'version' must be an integer >= 0, got {version!r}")
    if not isinstance(text, str) or not text.strip():
        raise ArticleFileError(f"{where}: 'text' must be a non-empty string")
    if title is not None and not isinstance(title, str):
        raise ArticleFileError(f"{where}: 'title' must be a string, got {type(title).__name__}")
    return Article(article_id, version, text, title, number)
