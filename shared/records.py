"""Reading a record another tokenbus service wrote: fields this release does not know are
ignored (ADR 0072).

Every record model forbids unknown fields (`Model`), so what comes from outside (a client's
frame, an OpenAI body, an application's request) names a misspelt field as an error. A
record a tokenbus service wrote is another matter: during a rolling upgrade its writer may
be a release newer than its reader, and a field that writer added would make the older
reader drop the record or dead-letter the request. The readers of such records read
through here, and ignore what they do not know; the models, and the published schemas,
stay strict about what a writer may write.
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

from pydantic import BaseModel, TypeAdapter

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


@overload
def read(kind: type[M], raw: str | bytes | bytearray, *, context: Any = None) -> M: ...


@overload
def read(kind: TypeAdapter[T], raw: str | bytes | bytearray, *, context: Any = None) -> T: ...


def read(
    kind: type[BaseModel] | TypeAdapter[Any], raw: str | bytes | bytearray, *, context: Any = None
) -> Any:
    """The record `raw` (JSON) holds, as `kind` (a model, or an adapter of a union of them)
    reads it, every field it does not know ignored, at any depth. Raises
    `ValidationError` as the model's own validation does for anything else wrong."""
    if isinstance(kind, TypeAdapter):
        return kind.validate_json(raw, extra="ignore", context=context)
    return kind.model_validate_json(raw, extra="ignore", context=context)


def read_value(kind: type[M], value: object) -> M:
    """As `read`, of a record already decoded from JSON (models in it are taken as they
    are)."""
    return kind.model_validate(value, extra="ignore")
