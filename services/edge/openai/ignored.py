"""The fields of an OpenAI request body that nothing reads: named in a log line, as vLLM does.

vLLM's server logs "The following fields were present in the request but ignored: ...";
the edge logs `openai.fields_ignored` with the same names (never their values: a field a
client sends by mistake may hold anything). Pure: the log call is the route's.
"""

from __future__ import annotations

from pydantic import BaseModel

# A log line stays bounded whatever a body holds.
MAX_NAMES = 32
MAX_NAME_CHARS = 64


def ignored_fields(body: BaseModel) -> list[str]:
    """The names of the fields the body's models do not declare (kept by `extra="allow"`),
    sorted: top-level ones by name, nested ones by path (`stream_options.x`,
    `messages[].x`); at most `MAX_NAMES`, each cut to `MAX_NAME_CHARS`."""
    names = sorted(set(_extras(body, "")))
    return [n[:MAX_NAME_CHARS] for n in names[:MAX_NAMES]]


def _extras(model: BaseModel, prefix: str) -> list[str]:
    found = [f"{prefix}{name}" for name in model.model_extra or {}]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        path = f"{prefix}{name}[]." if isinstance(value, list) else f"{prefix}{name}."
        for item in items:
            if isinstance(item, BaseModel):
                found += _extras(item, path)
    return found
