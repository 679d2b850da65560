"""Kafka passwords stay out of errors and command lines.

The attackers: whoever reads a service's crash log or error report (a settings error used
to print every input value, the SASL password among them), and any local user, who may
read every process's command line (`ps`, /proc/<pid>/cmdline): the launcher used to pass
every SCRAM user's password to kafka-storage as an argument.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from deploy.kafka import launcher
from deploy.kafka import secure as secured
from services.ingest.settings import IngestSettings
from shared.settings import TokenbusSettings
from tests.processes import free_port_pair

PASSWORD = "hunter2-do-not-print-me"


@pytest.mark.parametrize("settings", [TokenbusSettings, IngestSettings])
def test_a_settings_error_does_not_print_the_sasl_password(
    settings: type[TokenbusSettings], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENBUS_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("TOKENBUS_KAFKA_SASL_PASSWORD", PASSWORD)
    monkeypatch.setenv("TOKENBUS_KAFKA_SSL_KEY_PASSWORD", PASSWORD + "-key")
    # The user is missing: the whole-model check fails, with every input in hand.
    with pytest.raises(ValidationError) as refused:
        settings()
    assert "TOKENBUS_KAFKA_SASL_USERNAME" in str(refused.value)  # still says what is wrong
    for shown in (str(refused.value), repr(refused.value)):  # what a crash log prints
        assert PASSWORD not in shown
    # A bad field next to the password: only the reason, no input value.
    monkeypatch.setenv("TOKENBUS_KAFKA_SASL_USERNAME", "edge")
    monkeypatch.setenv("TOKENBUS_KAFKA_SECURITY_PROTOCOL", "SASL_SSL " + PASSWORD)
    with pytest.raises(ValidationError) as refused:
        settings()
    assert PASSWORD not in str(refused.value)


@pytest.mark.integration
def test_scram_passwords_never_reach_kafka_storages_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = launcher.Cluster(port=free_port_pair(), state_dir=tmp_path, secure=True)
    secured.ensure(cluster.secure_files)
    for node in cluster.nodes:
        node.state_dir.mkdir(parents=True, exist_ok=True)
        node.config_file.write_text(launcher.render_config(cluster, node))
    command_lines: list[list[str]] = []
    popen = subprocess.Popen

    def watched(args: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        command_lines.append(list(args))  # what `ps` shows of the tool
        return popen(args, **kwargs)

    monkeypatch.setattr(launcher.subprocess, "Popen", watched)
    java = launcher._find_tool("java", "a Java runtime")
    launcher._format_storage(cluster, cluster.nodes, java, launcher.resolve_classpath())

    assert command_lines  # the format ran, through the watched Popen
    shown = " ".join(" ".join(args) for args in command_lines)
    for user, password in cluster.secure_files.passwords().items():
        assert password not in shown, user
    # The users were still created (the file was read), and the file is gone.
    assert all((node.data_dir / "meta.properties").exists() for node in cluster.nodes)
    assert not list(cluster.secure_files.directory.glob("*.args"))
