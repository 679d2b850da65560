"""Issue 37 (Low): a pydantic ValidationError's `str()` quotes the input it refused, so a log
line built from it could carry a secret: a raw API key pasted into the keys file's `sha256`
field was written to the edge's log when the file was refused. Every log of a refused
record or file now names the fields and what is wrong with them, never their values.
"""

from __future__ import annotations

import json
from pathlib import Path

import structlog

from services.edge.keys import KeyStore, new_key
from shared.messages import ErrorResult, error_message


def test_a_keys_file_refused_is_logged_without_the_key_pasted_into_it(tmp_path: Path) -> None:
    secret = new_key()
    path = tmp_path / "keys.json"
    entry = {"id": "k-0123abcd", "sha256": secret, "tenant": "acme", "created_at": 1.0}
    path.write_text(json.dumps({"version": 1, "keys": [entry]}))
    with structlog.testing.capture_logs() as logs:
        KeyStore(path).refresh()
    [refused] = [e for e in logs if e["event"] == "keys.file_invalid"]
    assert "keys.0.sha256" in refused["error"], refused
    assert secret not in json.dumps(logs, default=str)
    assert secret[8:24] not in json.dumps(logs, default=str)


def test_a_refused_record_names_its_fields_not_their_values() -> None:
    secret = new_key()
    try:
        ErrorResult.model_validate_json(json.dumps({"request_id": secret, "code": secret}))
    except ValueError as exc:
        said = error_message(exc)
    else:
        raise AssertionError("the record was accepted")
    assert "code" in said
    assert secret not in said
    assert secret not in said.replace("'", "")
