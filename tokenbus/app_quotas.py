"""Kafka produce quotas for outside applications' principals (issue 37, N6).

Ingest charges an app's records by count and bytes before it parses them, but the records
are on the brokers' disks by then: nothing but a broker quota bounds how fast an app can
write its requests topic. `tokenbus topics create --acls --app NAME` sets a
`producer_byte_rate` (bytes a second, per broker) for each app's principal; a client over
it has its produce responses delayed by the broker (Kafka's client quotas, KIP-13/KIP-55).

aiokafka 0.14 has DescribeClientQuotas' request class but no AlterClientQuotas: its
version 0 is written here from Kafka's schema (`AlterClientQuotasRequest.json`: entries of
an entity and ops; flexible only from version 1), and both go through the admin client's
connection (`_send_request`), as `tokenbus/acls.py` sends CreateAcls, so TLS and SASL are
those of `make_admin`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiokafka.errors import for_code
from aiokafka.protocol.admin import DescribeClientQuotasRequest
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Array, Boolean, Float64, Int16, Int32, Schema, String

from shared.kafka import make_admin
from shared.settings import TokenbusSettings

PRODUCER_BYTE_RATE = "producer_byte_rate"
DEFAULT_APP_PRODUCE_BYTES_PER_S = 4 * 1024 * 1024  # per broker: twice ingest's 2 MB/s charge
MATCH_EXACT = 0  # DescribeClientQuotas' match_type


class QuotaError(Exception):
    """The broker refused to set a quota; the message says which and why."""


class AlterClientQuotasResponse_v0(Response):  # type: ignore[misc]
    API_KEY = 49
    API_VERSION = 0
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "entries",
            Array(
                ("error_code", Int16),
                ("error_message", String("utf-8")),
                (
                    "entity",
                    Array(("entity_type", String("utf-8")), ("entity_name", String("utf-8"))),
                ),
            ),
        ),
    )


class AlterClientQuotasRequest_v0(RequestStruct):  # type: ignore[misc]
    API_KEY = 49
    API_VERSION = 0
    RESPONSE_TYPE = AlterClientQuotasResponse_v0
    SCHEMA = Schema(
        (
            "entries",
            Array(
                (
                    "entity",
                    Array(("entity_type", String("utf-8")), ("entity_name", String("utf-8"))),
                ),
                ("ops", Array(("key", String("utf-8")), ("value", Float64), ("remove", Boolean))),
            ),
        ),
        ("validate_only", Boolean),
    )


class AlterClientQuotasRequest(Request[AlterClientQuotasRequest_v0]):  # type: ignore[misc]
    API_KEY = 49

    def __init__(self, entries: list[tuple[list[tuple[str, str]], list[tuple[str, float, bool]]]]):
        self._entries = entries

    def build(
        self, request_struct_class: type[AlterClientQuotasRequest_v0]
    ) -> AlterClientQuotasRequest_v0:
        return request_struct_class(self._entries, False)


def user_of(principal: str) -> str:
    """The quota entity name of a Kafka principal: `User:billing` -> `billing`."""
    kind, _, name = principal.partition(":")
    if kind != "User" or not name:
        raise ValueError(f"{principal!r}: a quota is set for a User: principal")
    return name


async def set_app_quotas(
    settings: TokenbusSettings, apps: Mapping[str, str], produce_bytes_per_s: int
) -> None:
    """Each app's principal (`apps`: name -> `User:...`) may write `produce_bytes_per_s` a
    second to each broker; raise `QuotaError` on a refusal."""
    if not apps:
        return
    entries = [
        ([("user", user_of(principal))], [(PRODUCER_BYTE_RATE, float(produce_bytes_per_s), False)])
        for principal in apps.values()
    ]
    response = await _send(settings, AlterClientQuotasRequest(entries))
    failures = [
        f"{entity}: {for_code(code).__name__} {message or ''}".rstrip()
        for code, message, entity in response.entries
        if code != 0
    ]
    if failures:
        raise QuotaError("the broker refused these quotas:\n  " + "\n  ".join(failures))


async def user_quotas(settings: TokenbusSettings, principal: str) -> dict[str, float]:
    """The quotas set for exactly `principal`'s user entity (name -> value)."""
    request = DescribeClientQuotasRequest([("user", MATCH_EXACT, user_of(principal))], True)
    response = await _send(settings, request)
    if response.error_code != 0:
        raise QuotaError(f"{for_code(response.error_code).__name__} {response.error_message}")
    return {name: value for _, values in response.entries for name, value in values}


async def _send(settings: TokenbusSettings, request: Any) -> Any:
    """`request`'s response, over an admin client's connection (its TLS and SASL login)."""
    admin = make_admin(settings, client_id="tokenbus-quotas")
    await admin.start()
    try:
        return await admin._send_request(request)
    finally:
        await admin.close()
