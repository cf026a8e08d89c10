"""Oncelery's exceptions: one root, typed subtrees, every one picklable with its extra fields; and its warning."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "BrokerNotConfigured",
    "ClaimError",
    "ConfigurationError",
    "DriverMissing",
    "ForkRefused",
    "IdempotencyConflict",
    "InProgress",
    "InvalidKey",
    "LeaseLost",
    "ModelCallNotBudgeted",
    "OnceleryError",
    "PayloadError",
    "PayloadNotJSON",
    "PayloadTooLarge",
    "PlaceholderSecret",
    "ResultNotJSON",
    "RunIsDead",
    "RunParked",
    "SchemaMissing",
    "ServiceUnreachable",
    "SettingFileError",
    "StaleVersion",
    "StepMismatch",
    "StoreError",
    "StoreUnavailable",
    "UnknownOption",
]


class OnceleryError(Exception):
    """Root of every error Oncelery raises."""

    def __init__(self, message: str = "", context: dict[str, Any] | None = None, **fields: Any) -> None:
        fields = {**(context or {}), **fields}
        # The fields travel in args: Celery's JSON result backend stores an exception as its type and args
        # and rebuilds it as cls(*args), so (message, fields) brings `.key`, `.fields`... back to the caller.
        super().__init__(*((message, fields) if fields else (message,)))
        self.message = message
        # Extra fields are also attributes (e.g. IdempotencyConflict.fields is the differing names).
        self.context = fields
        for name, value in fields.items():
            setattr(self, name, value)

    def __reduce__(self) -> tuple[Any, ...]:
        # Celery pickles exceptions between pool processes and into result backends; rebuilding from
        # (message, **fields) keeps subclasses with extra fields intact (Exception's default drops them).
        return (_rebuild, (type(self), self.message, self.context))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type[OnceleryError], message: str, context: dict[str, Any]) -> OnceleryError:
    return cls(message, **context)


class ConfigurationError(OnceleryError):
    """Raised when a task option or setting is invalid; raised at decoration or call time, not at 3 a.m."""


class ServiceUnreachable(ConfigurationError):
    """Raised by a command's up-front check when its broker, result backend or database does not answer."""

    @classmethod
    def of(cls, what: str, setting: str, url: str, reason: str) -> ServiceUnreachable:
        """The one-line message: which service, the setting that names it, its masked URL, and why."""
        return cls(f"cannot reach the {what} {setting}={url}: {reason}", what=what, setting=setting, url=url)


class BrokerNotConfigured(ConfigurationError):
    """Raised when a command would publish to the embedded demo broker for a claims database that is not the demo's."""

    @classmethod
    def of(cls, command: str, database: str) -> BrokerNotConfigured:
        """The one-line message: the command, what to pass, and why the embedded broker is refused."""
        return cls(
            f"`oncelery {command}` publishes, and no broker is configured: pass --app MODULE:APP (the Celery app "
            f"your workers run) or set ONCELERY_BROKER_URL; the embedded broker ./.oncelery/broker is read only by "
            f"the demo's workers, on the demo's database ./oncelery.db, not {database}",
            command=command,
        )


class DriverMissing(ConfigurationError):
    """Raised when a database URL needs a driver that is not installed (an optional extra of oncelery)."""

    @classmethod
    def of(cls, database: str, driver: str, extra: str) -> DriverMissing:
        """The one-line message: which database needs which driver, and the pip command that installs it."""
        return cls(
            f"{database} needs the {driver} driver, which is not installed: pip install 'oncelery[{extra}]'",
            driver=driver,
            extra=extra,
        )


class ExtraMissing(ConfigurationError):
    """Raised when a feature that is switched on needs an optional extra of oncelery that is not installed."""

    @classmethod
    def of(cls, feature: str, package: str, extra: str) -> ExtraMissing:
        """The one-line message: which feature needs which package, and the pip command that installs it."""
        return cls(
            f"{feature} needs {package}, which is not installed: pip install 'oncelery[{extra}]'",
            package=package,
            extra=extra,
        )


class UnknownOption(ConfigurationError):
    """Raised when a task or a call is given an option that looks like one of Oncelery's but is none of them."""

    @classmethod
    def of(cls, where: str, name: str, close: str | None, known: Sequence[str]) -> UnknownOption:
        """The one-line message: the unknown option, and the option it is close to or the ones that exist."""
        hint = f"did you mean {close}=?" if close else f"Oncelery's options here are {', '.join(known)}"
        return cls(f"{where} {name}= is not an Oncelery option; {hint}", option=name, suggestion=close)


class SettingFileError(ConfigurationError):
    """Raised when VAR_FILE (a file holding VAR's value) cannot be used: VAR set too, or unreadable, or empty."""

    @classmethod
    def both_set(cls, name: str) -> SettingFileError:
        """The one-line message when VAR and VAR_FILE are both set: keep one."""
        return cls(
            f"both {name} and {name}_FILE are set: keep one ({name}_FILE names a file holding the value)",
            setting=name,
        )

    @classmethod
    def unreadable(cls, name: str, path: str, reason: Exception) -> SettingFileError:
        """The one-line message when VAR_FILE's file cannot be read, with the reason."""
        why = getattr(reason, "strerror", None) or str(reason)
        return cls(f"{name}_FILE={path}: cannot read it ({why}); mount the secret there", setting=name, path=path)

    @classmethod
    def empty(cls, name: str, path: str) -> SettingFileError:
        """The one-line message when VAR_FILE's file is empty."""
        return cls(f"{name}_FILE={path} is empty: write {name}'s value into it", setting=name, path=path)


class PlaceholderSecret(ConfigurationError):
    """Raised by a service's start guard when a setting still holds .env.example's `change-me` placeholder."""

    @classmethod
    def of(cls, name: str, placeholder: str) -> PlaceholderSecret:
        """The one-line message: the setting, and how to make a real secret."""
        return cls(
            f"{name} holds the placeholder {placeholder!r} from .env.example: set a real secret in .env "
            "(e.g. `openssl rand -hex 24`), then start again",
            setting=name,
        )


class InvalidKey(ConfigurationError):
    """Raised when an idempotency key is empty, longer than 255 characters, or has control characters."""


class ForkRefused(InvalidKey):
    """Raised when a call names a fork's run without being that fork: a producer's `fork:` key (only the fork
    command sends one), or a fork's message whose fork row is another tenant's, task's or key's."""

    @classmethod
    def reserved(cls, task_name: str, key: str) -> ForkRefused:
        """The message for a producer's key in the fork namespace: give the call a key of its own."""
        return cls(
            f"{task_name}: the key {key[:80]!r} starts with 'fork:', the namespace of forked runs, which only "
            f"`oncelery fork` sends (oncelery.fork_run); nothing was sent: give this call a key of its own",
            task_name=task_name,
            key=key,
        )

    @classmethod
    def not_sent_as_fork(cls, task_name: str, key: str, why: str) -> ForkRefused:
        """The message for a worker's delivery that is not the fork its key names, and `why`."""
        return cls(
            f"{task_name}[{key[:80]}]: refused: {why}; a fork's run is sent only by `oncelery fork` (fork_run), under "
            f"its source run's tenant: fork the run with `oncelery fork KEY --task {task_name} --tenant TENANT`",
            task_name=task_name,
            key=key,
        )


class PayloadError(ConfigurationError):
    """Root of the errors about a call's arguments that no worker could take (not JSON, too large)."""


class PayloadNotJSON(PayloadError):
    """Raised when a fingerprinted argument cannot be encoded as canonical JSON."""


class PayloadTooLarge(PayloadError):
    """Raised at the call when its arguments' JSON is over app.conf.oncelery_max_payload_bytes; nothing is sent."""

    @classmethod
    def of(cls, task_name: str, size: int, limit: int) -> PayloadTooLarge:
        """The one-line message: the task, the payload's size, the limit, and what to send instead."""
        return cls(
            f"{task_name}: the arguments are {size} bytes of JSON, over oncelery_max_payload_bytes={limit}; "
            f"nothing was sent: store the data (a table, object storage) and pass a reference (an id, a URL)",
            task_name=task_name,
            size=size,
            limit=limit,
        )


class ClaimError(OnceleryError):
    """Root of the errors about who may run a key."""


class IdempotencyConflict(ClaimError):
    """Raised when a key is reused with a different payload; names the key and the fields that differ."""

    fields: list[str]  # the differing fields' names (empty where the digests cannot tell), set by the constructor


class InProgress(ClaimError):
    """Raised (with on_in_progress="raise") when another live holder is running the same key or entity."""


class LeaseLost(ClaimError):
    """Raised when a holder's fencing token is stale: another worker took the run over; nothing commits."""

    @classmethod
    def for_holder(cls, task_name: str, key: str, token: int, what: str = "its writes were rolled back") -> LeaseLost:
        """The one message of a lost lease: who lost it, which token, and what was not written."""
        return cls(
            f"{task_name}[{key}]: fencing token {token} is stale — another worker took the run over after this "
            f"holder's lease expired; {what}",
            task_name=task_name,
            key=key,
            token=token,
        )


class RunIsDead(ClaimError):
    """Raised for a delivery of a DEAD run: it is not run again until `oncelery dlq replay` (after a fix)."""


class StaleVersion(ClaimError):
    """Raised when an event's version is not newer than its entity's applied one: it is acked, not applied."""

    @classmethod
    def of(cls, entity: str, version: int, applied: int | None = None) -> StaleVersion:
        """The message of a stale event: which entity, which version, and the applied one if known."""
        seen = f" (applied: {applied})" if applied is not None else ""
        return cls(
            f"version {version} of entity {entity!r} is not newer than its applied version{seen}; "
            f"the event is acked without running",
            entity=entity,
            version=version,
        )


class ResultNotJSON(OnceleryError):
    """Raised when a task's result or a step's result cannot be stored as JSON; nothing is committed."""


class RunParked(BaseException):
    """Raised inside a run's body to park it WAITING for `wake_in_s` seconds without a worker slot; never a failure.

    A BaseException, as Celery's and Python's own control flow is: a body's `except Exception` must not swallow
    it (the run would complete without its step). The delivery catches it, parks the run (fenced) and acks.
    """

    def __init__(self, wake_in_s: float, reason: str) -> None:
        super().__init__(wake_in_s, reason)
        self.wake_in_s = wake_in_s
        self.reason = reason

    def __str__(self) -> str:
        return f"parked for {self.wake_in_s:.1f}s: {self.reason}"


class StepMismatch(OnceleryError):
    """Raised when a step's name differs from the checkpoint at its position (the pipeline code changed)."""


class StoreError(OnceleryError):
    """Root of the errors about the database behind the claims."""


class SchemaMissing(StoreError):
    """Raised when Oncelery's tables do not exist in the configured database (or are behind the code)."""

    @classmethod
    def for_url(cls, url: str, detail: str = "Oncelery's tables are missing") -> SchemaMissing:
        """The message that names the fix: run `oncelery db upgrade` against this database."""
        return cls(
            f"{detail} in {url}: run `oncelery db upgrade` (with ONCELERY_DATABASE_URL set to this database)",
            url=url,
        )


class StoreUnavailable(StoreError):
    """Raised when the claims database cannot be reached; the job is retried, never dropped."""


class ModelCallNotBudgeted(UserWarning):
    """Warned once per task and process: budgets or limits apply, and `model_call` is neither admitted nor reserved."""
