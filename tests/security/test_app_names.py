"""Issue 37 (Low): an outside application may not take a service's name or principal.

An app logs in as `User:<name>` unless told otherwise, and its name is its tenant: an app
named `edge` (or one given the principal `User:edge`) was granted its app ACLs on the edge
service's own principal, and ingest read its tenant as a service's. Refused wherever an app
is named: `tokenbus topics create --app`, the ACLs it writes, and ingest's TOKENBUS_INGEST_APPS.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.ingest.settings import IngestSettings
from shared.topics import RESERVED_APP_NAMES, Topics
from tokenbus.acls import app_acls, parse_apps


@pytest.mark.parametrize("name", sorted(RESERVED_APP_NAMES))
def test_a_service_name_is_refused_as_an_app(name: str) -> None:
    with pytest.raises(ValueError, match="is a service's"):
        parse_apps([name])
    with pytest.raises(ValueError, match="is a service's"):
        app_acls(Topics("tb"), name)
    with pytest.raises(ValidationError, match="is a service's"):
        IngestSettings(ingest_apps=f"billing,{name}")


@pytest.mark.parametrize("principal", ["User:edge", "worker", "User:ingest"])
def test_a_services_principal_is_refused_for_an_app(principal: str) -> None:
    with pytest.raises(ValueError, match="is a service's principal"):
        parse_apps([f"billing={principal}"])


def test_other_names_and_principals_still_pass() -> None:
    assert parse_apps(["billing", "crm=User:crm-prod"]) == {
        "billing": "User:billing",
        "crm": "User:crm-prod",
    }
    assert IngestSettings(ingest_apps="billing,edge-analytics").ingest_apps
