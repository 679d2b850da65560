"""tokenbus.app_quotas and `tokenbus topics create --app-produce-bytes-per-s`: what is
refused before anything reaches Kafka (the quota on a secured broker:
`tests/security/test_kafka_identity.py::test_each_apps_principal_has_a_kafka_produce_quota`)."""

from __future__ import annotations

import pytest

from tokenbus.app_quotas import AlterClientQuotasRequest, AlterClientQuotasRequest_v0, user_of
from tokenbus.cli import main


def test_a_quota_is_for_a_user_principal() -> None:
    assert user_of("User:billing-prod") == "billing-prod"
    for principal in ("Group:billing", "billing", "User:"):
        with pytest.raises(ValueError, match="User: principal"):
            user_of(principal)


def test_the_request_is_kafkas_alter_client_quotas_v0() -> None:
    """Kafka's AlterClientQuotasRequest v0: entries of (entity, ops), then validate_only."""
    entries = [([("user", "billing")], [("producer_byte_rate", 1024.0, False)])]
    struct = AlterClientQuotasRequest(entries).prepare({49: (0, 1)})
    assert isinstance(struct, AlterClientQuotasRequest_v0)
    assert (struct.API_KEY, struct.API_VERSION) == (49, 0)
    encoded = struct.encode()
    assert encoded[:4] == (1).to_bytes(4, "big")  # one entry
    assert b"user" in encoded
    assert b"billing" in encoded
    assert b"producer_byte_rate" in encoded
    assert encoded[-1:] == b"\x00"  # validate_only: false


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--app-produce-bytes-per-s", "0"], "--app-produce-bytes-per-s must be at least 1"),
        (["--acls", "--app", "billing=Group:billing"], "a quota is set for a User: principal"),
    ],
)
def test_topics_create_refuses_a_bad_quota_before_kafka(
    args: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["topics", "create", *args]) == 2
    assert error in capsys.readouterr().err
