"""Model prices from a maintained file: LiteLLM's `model_prices_and_context_window.json`, a copy shipped in the wheel.

`oncelery.price_of` asks the app's `oncelery_prices` first (the user's overrides win), then this table. The table is
read once per process and file (lazily: a process that prices nothing never reads it), with every number parsed as
a Decimal (`json.loads(..., parse_float=Decimal)`), so LiteLLM's USD per token becomes USD per 1M tokens EXACTLY:
`Decimal("1.5e-07")` per token is `Decimal("0.15")` per 1M, never 0.15000000000000002.

Which file (`app.conf.oncelery_price_file`, oncelery.settings.price_file): unset, the shipped copy
(`data/model_prices.json`, its source and licence in `data/NOTICE.md`); None or False, none; a path, that file, in
LiteLLM's format (the whole upstream file works as it is: a user refreshes prices by pointing at a newer one).

Why the shipped copy is trimmed (`trim`): the upstream file is ~3.5 MB, most of it capabilities, context windows and
image, audio and search prices that a token ledger never reads. The copy keeps every entry that has a per-token
price, with only the fields read here (`input_cost_per_token`, `output_cost_per_token`, `litellm_provider`), each
number as written upstream (so it parses to the same Decimal): about a sixth of the size, the same prices.

A model is found by its name as given, else (`openai/gpt-4o`) by the name after a provider prefix when that entry's
provider is the prefix or of its family (`vertex_ai` for `vertex_ai-language-models`). Imports no Celery: `conf` is
any mapping with `.get`.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import ROUND_CEILING, Context, Decimal, localcontext
from pathlib import Path
from typing import Any, NamedTuple

from oncelery.errors import ConfigurationError
from oncelery.models.money import as_decimal, micros_up
from oncelery.settings import CONF_PRICE_FILE, CONF_PRICES, price_file

__all__ = [
    "BATCH_PRICE",
    "PER_TOKENS",
    "SHIPPED_PRICE_FILE",
    "Amount",
    "PerMillion",
    "Price",
    "PriceTable",
    "batch_micros",
    "file_price",
    "load_price_table",
    "price_for",
    "price_table",
    "trim",
]

PER_TOKENS_EXPONENT = 6  # a per-token price is scaled to PER_TOKENS by moving its exponent: exact
PER_TOKENS: int = 10**PER_TOKENS_EXPONENT  # prices are per this many tokens (1M; LiteLLM's are per one)
SHIPPED_PRICE_FILE = Path(__file__).with_name("data") / "model_prices.json"
INPUT_FIELD = "input_cost_per_token"
OUTPUT_FIELD = "output_cost_per_token"
PROVIDER_FIELD = "litellm_provider"
KEPT_FIELDS = (INPUT_FIELD, OUTPUT_FIELD, PROVIDER_FIELD)  # what `trim` keeps of each entry
NOT_A_MODEL = "sample_spec"  # LiteLLM's first entry documents the fields (with zero prices): never a price
# What a batch call costs against a synchronous one: OpenAI's Batch API, Anthropic's Message Batches and Gemini's
# batch mode all bill about 50 %. The ledger and the budgets price batch items at this share of a model's price.
BATCH_PRICE = Decimal("0.5")
_ONE = Decimal(1)
_EXACT = Context(prec=80)  # scaling by 10**6 only moves the exponent: no digit is ever rounded
_FIX = (
    f"give app.conf.{CONF_PRICE_FILE} the path of a file in LiteLLM's model_prices_and_context_window.json format, "
    f"or None to price from app.conf.{CONF_PRICES} alone"
)


class PerMillion(NamedTuple):
    """A model's price in USD per 1M tokens (PER_TOKENS), input and output, exact."""

    input: Decimal
    output: Decimal


class PriceTable:
    """One price file, parsed: looks a model up and returns its exact price per 1M tokens, or None."""

    def __init__(self, path: Path, entries: Mapping[str, Any]) -> None:
        self.path = path
        self._entries = entries

    def __len__(self) -> int:
        return len(self._entries)

    def per_million(self, model: str) -> PerMillion | None:
        """`model`'s price (by its name, else its name after a provider prefix); None: no per-token price.

        An entry with a price that is not a number >= 0 raises ConfigurationError naming the file and the model.
        """
        found = self._entry(model)
        if found is None:
            return None
        name, entry = found
        if INPUT_FIELD not in entry and OUTPUT_FIELD not in entry:
            return None  # priced per image, second or query: not by tokens
        # A missing one of the two is 0, as in oncelery_prices (LiteLLM leaves out an embedding's output price).
        prices = (self._per_million(name, field, entry.get(field, 0)) for field in (INPUT_FIELD, OUTPUT_FIELD))
        return PerMillion(*prices)

    def _entry(self, model: str) -> tuple[str, Mapping[str, Any]] | None:
        entry = self._entries.get(model) if model != NOT_A_MODEL else None
        if isinstance(entry, Mapping):
            return model, entry
        prefix, _, rest = model.partition("/")
        entry = self._entries.get(rest) if rest else None
        if isinstance(entry, Mapping) and _of_provider(entry.get(PROVIDER_FIELD), prefix):
            return rest, entry
        return None

    def _per_million(self, model: str, field: str, value: Any) -> Decimal:
        amount = None if isinstance(value, bool) or not isinstance(value, int | Decimal) else Decimal(value)
        if amount is None or not amount.is_finite() or amount < 0:
            raise ConfigurationError(
                f"{self.path}: [{model!r}][{field!r}] = {value!r}: give a number >= 0 (USD per token) or remove the "
                f"entry; or {_FIX}"
            )
        scaled = amount.scaleb(PER_TOKENS_EXPONENT, _EXACT)
        # 1e-05 per token is 10 per 1M, not Decimal("1E+1"): a price is read back in reports and reservations.
        whole = scaled == scaled.to_integral_value(context=_EXACT)
        return scaled.quantize(_ONE, context=_EXACT) if whole else scaled


def _of_provider(provider: Any, prefix: str) -> bool:
    """Whether `prefix` names `provider` (LiteLLM's `litellm_provider`) or its family: `openai/` covers
    `text-completion-openai`, `vertex_ai/` covers `vertex_ai-language-models`."""
    if not isinstance(provider, str) or not prefix:
        return False
    return provider == prefix or provider.startswith(f"{prefix}-") or provider.endswith(f"-{prefix}")


@functools.lru_cache(maxsize=8)
def load_price_table(path: Path) -> PriceTable:
    """The price table in `path` (LiteLLM's format), read and parsed once per process and path (exact Decimals).

    A file that cannot be read, is not JSON or is not an object of model entries raises ConfigurationError saying
    what to give instead (not cached: the next call reads it again).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"cannot read the price file {path} ({exc}); {_FIX}") from exc
    try:
        entries = json.loads(text, parse_float=Decimal)
    except ValueError as exc:
        raise ConfigurationError(f"the price file {path} is not JSON ({exc}); {_FIX}") from exc
    if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
        raise ConfigurationError(
            f"the price file {path} is not a price table: it must be a JSON object of model -> "
            f'{{"{INPUT_FIELD}": usd, "{OUTPUT_FIELD}": usd}}; {_FIX}'
        )
    return PriceTable(path, entries)


def price_table(conf: Any) -> PriceTable | None:
    """The price table `conf`'s `oncelery_price_file` names (unset: the shipped one), loaded once; None: off."""
    path = price_file(conf, SHIPPED_PRICE_FILE)
    return None if path is None else load_price_table(path)


def file_price(model: str, conf: Any) -> PerMillion | None:
    """`model`'s price in the price table `conf` names (see `price_table`), or None."""
    table = price_table(conf)
    return None if table is None else table.per_million(model)


class _Literal(str):
    """A JSON number as written in the source (so the trimmed file parses to the very same Decimal)."""

    __slots__ = ()


def trim(text: str) -> str:
    """LiteLLM's price file cut to what Oncelery reads: every entry with a per-token price, with the fields in
    KEPT_FIELDS only and each number exactly as written; one entry per line (a refresh diffs line by line)."""
    entries = json.loads(text, parse_float=_Literal, parse_int=_Literal)
    lines = []
    for model, entry in entries.items():
        if model == NOT_A_MODEL or not isinstance(entry, dict) or not {INPUT_FIELD, OUTPUT_FIELD} & entry.keys():
            continue
        fields = (f"{json.dumps(name)}: {_json(entry[name])}" for name in KEPT_FIELDS if name in entry)
        lines.append(f"{json.dumps(model)}: {{{', '.join(fields)}}}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _json(value: Any) -> str:
    return str(value) if isinstance(value, _Literal) else json.dumps(value)


Amount = Decimal | float | int | str  # a USD amount as a user may give it


@dataclass(frozen=True, init=False)
class Price:
    """A model's price in USD per 1M tokens (PER_TOKENS), input and output, held as exact Decimals.

    Given as numbers (a float by its shortest repr: `0.15` is `Decimal("0.15")`), a Decimal or a numeric string.
    """

    input: Decimal
    output: Decimal

    def __init__(self, input: Amount = 0, output: Amount = 0) -> None:
        object.__setattr__(self, "input", as_decimal(input))
        object.__setattr__(self, "output", as_decimal(output))

    def cost(self, input_tokens: int, output_tokens: int) -> Decimal:
        """The exact USD cost of a call with these token counts (Decimal arithmetic, no rounding)."""
        with localcontext(prec=80):  # enough digits for any price times any count: the product is exact
            return (input_tokens * self.input + output_tokens * self.output) / PER_TOKENS

    def cost_micros(self, input_tokens: int, output_tokens: int) -> int:
        """The call's cost as the ledger stores it: integer micro-USD, rounded UP (never under-reported)."""
        return micros_up(self.cost(input_tokens, output_tokens))

    @classmethod
    def of(cls, model: str, entry: Any) -> Price:
        """Parse one entry of the price table, or raise ConfigurationError naming the model and the fix."""
        fields = set(entry) if isinstance(entry, Mapping) else set()
        if not fields or not fields <= {"input", "output"}:
            raise ConfigurationError(
                f"{CONF_PRICES}[{model!r}] = {entry!r}: give {{'input': usd, 'output': usd}} in USD per 1M tokens "
                f"(a missing one is 0)"
            )
        values = {name: _amount(model, name, entry[name]) for name in fields}
        return cls(**values)


def _amount(model: str, name: str, value: Any) -> Decimal:
    """One price of the table as a Decimal (`Decimal(str(float))`), or ConfigurationError naming the fix."""
    try:
        amount = None if isinstance(value, bool) or not isinstance(value, int | float | Decimal) else as_decimal(value)
    except (TypeError, ValueError, ArithmeticError):
        amount = None
    if amount is None or not amount.is_finite() or amount < 0:
        raise ConfigurationError(f"{CONF_PRICES}[{model!r}][{name!r}] = {value!r}: give a number >= 0")
    return amount


def batch_micros(micros: int) -> int:
    """A synchronous cost (micro-USD) at the batch price, rounded up (the ledger never under-reports)."""
    return int((Decimal(int(micros)) * BATCH_PRICE).to_integral_value(rounding=ROUND_CEILING))


def price_for(model: str, conf: Any) -> Price | None:
    """The price of `model` for `conf` (an app's settings: any mapping with `.get`): its `oncelery_prices[model]`
    if given (the user's overrides win), else the price file's (`oncelery_price_file`: default, LiteLLM's table
    shipped in the wheel), else None. A bad table or file raises ConfigurationError naming the fix."""
    table = conf.get(CONF_PRICES)
    if table is not None and not isinstance(table, Mapping):
        raise ConfigurationError(f"{CONF_PRICES} must be a dict of model -> {{'input': usd, 'output': usd}}")
    entry = None if table is None else table.get(model)
    if entry is not None:
        return Price.of(model, entry)
    found = file_price(model, conf)
    return None if found is None else Price(found.input, found.output)


if __name__ == "__main__":  # python -m oncelery.ledger.prices model_prices_and_context_window.json > model_prices.json
    sys.stdout.write(trim(Path(sys.argv[1]).read_text(encoding="utf-8")))
