"""A secured local cluster: a CA and certificates, SCRAM users, and each user's client settings."""

# Stdlib and the `openssl` command only, like launcher.py. Everything lives in
# <state-dir>/secure and is made once: restarts keep the CA, the certificates and the
# passwords the storage was formatted with.

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Who logs in: `admin` is the super user (ACLs, topics, the brokers' own links), the
# others get only what `tokenbus topics create --acls` grants their role.
ADMIN = "admin"
# Two outside applications' logins, each its own principal (`tokenbus topics create --acls
# --app app --app app2` grants each its own topics only; ADR 0044).
APPS = ("app", "app2")
USERS = (ADMIN, "edge", "ingest", "scheduler", "worker", *APPS)
MECHANISM = "SCRAM-SHA-512"
# The same users and passwords also log in with PLAIN (over TLS): librdkafka before 2.6.1
# (kcat 1.7 on Debian 12 has 2.0.2) fails SCRAM against Kafka 4 (librdkafka#4895).
MECHANISMS = (MECHANISM, "PLAIN")
CLIENT_LISTENER = "SASL_SSL"
# The controllers' own listener stays on loopback without TLS, but not anonymous: a
# PLAIN login the brokers and controllers share, so no unauthenticated principal needs to
# be a super user (KRaft cannot use SCRAM there: its users live in the metadata log).
CONTROLLER_PROTOCOL = "SASL_PLAINTEXT"
CONTROLLER_USER = "controller"
CERT_DAYS = 825


class SecureError(Exception):
    """The secured cluster's files cannot be made; the message says why."""


@dataclass(frozen=True)
class SecureFiles:
    """Where a secured cluster keeps its CA, certificates and passwords (`<state-dir>/secure`)."""

    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def broker_keystore(self) -> Path:
        """The brokers' key and certificate (127.0.0.1, localhost) in one PEM file."""
        return self.directory / "broker.pem"

    @property
    def client_cert(self) -> Path:
        return self.directory / "client.pem"

    @property
    def client_key(self) -> Path:
        return self.directory / "client.key"

    @property
    def passwords_file(self) -> Path:
        return self.directory / "passwords.json"

    def env_file(self, user: str) -> Path:
        return self.directory / f"{user}.env"

    def passwords(self) -> dict[str, str]:
        loaded: dict[str, str] = json.loads(self.passwords_file.read_text())
        return loaded


def ensure(files: SecureFiles) -> None:
    """Make the CA, broker and client certificates and the passwords, where missing."""
    files.directory.mkdir(parents=True, exist_ok=True)
    os.chmod(files.directory, 0o700)
    if not files.passwords_file.exists():
        wanted = [*USERS, CONTROLLER_USER]
        _write_private(
            files.passwords_file,
            json.dumps({u: secrets.token_urlsafe(24) for u in wanted}, indent=2),
        )
    if files.ca_cert.exists() and files.broker_keystore.exists() and files.client_key.exists():
        return
    openssl = shutil.which("openssl")
    if openssl is None:
        raise SecureError("`openssl` not found on PATH: install OpenSSL (apt-get install openssl)")
    with tempfile.TemporaryDirectory(dir=files.directory) as scratch:
        work = Path(scratch)
        _openssl(openssl, "req", "-x509", *_new_key(work / "ca.key"), "-out", str(work / "ca.pem"),
                 "-subj", "/CN=tokenbus local CA", "-days", str(CERT_DAYS),
                 "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
        # Both ends of a broker-to-broker link present this one: server and client use.
        _signed(openssl, work, "broker", "localhost",
                "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                "extendedKeyUsage=serverAuth,clientAuth\n")  # fmt: skip
        _signed(openssl, work, "client", "tokenbus client", "extendedKeyUsage=clientAuth\n")
        keystore = (work / "broker.key").read_text() + (work / "broker.crt").read_text()
        _write_private(work / "broker.pem", keystore)
        # The CA's key stays behind in the scratch dir: nothing is signed after this.
        for name in ("ca.pem", "broker.pem", "client.key"):
            (work / name).replace(files.directory / name)
        (work / "client.crt").replace(files.client_cert)


def server_properties(files: SecureFiles) -> str:
    """The config lines a node adds for SASL_SSL clients, the authorizer and the controllers."""
    passwords = files.passwords()
    admin_login = _jaas("scram.ScramLoginModule", ADMIN, passwords[ADMIN])
    plain_users = [f'user_{user}="{passwords[user]}"' for user in USERS]
    plain_login = _jaas("plain.PlainLoginModule", ADMIN, passwords[ADMIN], *plain_users)
    controller_login = _jaas(
        "plain.PlainLoginModule",
        CONTROLLER_USER,
        passwords[CONTROLLER_USER],
        f'user_{CONTROLLER_USER}="{passwords[CONTROLLER_USER]}"',
    )
    return f"""
# --- secured (`start --secure`, deploy/kafka/secure.py) ---
# Clients: TLS with a client certificate, then a SCRAM-SHA-512 (or PLAIN) login; the
# brokers talk to each other the same way as `{ADMIN}`.
sasl.enabled.mechanisms={",".join(MECHANISMS)}
sasl.mechanism.inter.broker.protocol={MECHANISM}
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config={admin_login}
listener.name.sasl_ssl.plain.sasl.jaas.config={plain_login}
ssl.keystore.type=PEM
ssl.keystore.location={files.broker_keystore}
ssl.truststore.type=PEM
ssl.truststore.location={files.ca_cert}
listener.name.sasl_ssl.ssl.client.auth=required
# Controllers: a PLAIN login on loopback.
sasl.mechanism.controller.protocol=PLAIN
listener.name.controller.sasl.enabled.mechanisms=PLAIN
listener.name.controller.plain.sasl.jaas.config={controller_login}
# Nothing is allowed that no ACL grants; the admin and the controllers may do anything.
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:{ADMIN};User:{CONTROLLER_USER}
"""


def format_arguments(files: SecureFiles) -> list[str]:
    """`kafka-storage format` arguments that create every SCRAM user in the new metadata log."""
    passwords = files.passwords()
    return [
        arg
        for user in USERS
        for arg in ("--add-scram", f"{MECHANISM}=[name={user},password={passwords[user]}]")
    ]


def write_format_argfile(files: SecureFiles, path: Path) -> None:
    """`format_arguments` in a private file passed as `@path`, which kafka-storage reads as
    one argument a line (its parser's `@file` arguments): the passwords stay off the
    command line, which every local user may read (`ps`, /proc/<pid>/cmdline)."""
    _write_private(path, "".join(f"{arg}\n" for arg in format_arguments(files)))


def client_env(
    files: SecureFiles, user: str, bootstrap_servers: str, mechanism: str = MECHANISM
) -> dict[str, str]:
    """The `TOKENBUS_KAFKA_*` settings of a client that logs in as `user`."""
    return {
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers,
        "TOKENBUS_KAFKA_SECURITY_PROTOCOL": CLIENT_LISTENER,
        "TOKENBUS_KAFKA_SASL_MECHANISM": mechanism,
        "TOKENBUS_KAFKA_SASL_USERNAME": user,
        "TOKENBUS_KAFKA_SASL_PASSWORD": files.passwords()[user],
        "TOKENBUS_KAFKA_SSL_CAFILE": str(files.ca_cert),
        "TOKENBUS_KAFKA_SSL_CERTFILE": str(files.client_cert),
        "TOKENBUS_KAFKA_SSL_KEYFILE": str(files.client_key),
    }


def write_env_files(files: SecureFiles, bootstrap_servers: str) -> None:
    """One `<user>.env` per user (`set -a; . <file>` before starting that process)."""
    for user in USERS:
        lines = [f"{k}={v}" for k, v in client_env(files, user, bootstrap_servers).items()]
        _write_private(files.env_file(user), "\n".join(lines) + "\n")


def accepts_tls(files: SecureFiles, host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether `host:port` completes a TLS handshake with a certificate of this CA."""
    context = ssl.create_default_context(cafile=files.ca_cert)
    context.load_cert_chain(files.client_cert, files.client_key)
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except (OSError, ssl.SSLError):
        return False


def usage(files: SecureFiles) -> str:
    """What `start --secure` prints: where the settings are and how to use them."""
    return (
        f"secured: {CLIENT_LISTENER} ({' or '.join(MECHANISMS)}, client certificates) with ACLs; "
        f"CA and certificates in {files.directory}\n"
        f"  each user's client settings: {files.directory}/<user>.env "
        f"(users: {', '.join(USERS)})\n"
        f"  grant the services' ACLs:   (set -a; . {files.env_file(ADMIN)}; "
        f"tokenbus topics create --acls {' '.join(f'--app {a}' for a in APPS)})\n"
        f"  run a service as its user:  (set -a; . {files.env_file('edge')}; "
        "python -m services.edge)"
    )


def _jaas(module: str, user: str, password: str, *extra: str) -> str:
    options = " ".join((f'username="{user}"', f'password="{password}"', *extra))
    return f"org.apache.kafka.common.security.{module} required {options};"


def _new_key(path: Path) -> tuple[str, ...]:
    # EC P-256: made in milliseconds; an unencrypted PKCS#8 key, which Kafka's PEM keystore
    # and Python's ssl module both read.
    return ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(path))  # fmt: skip


def _signed(openssl: str, work: Path, name: str, common_name: str, extensions: str) -> None:
    """A key and a certificate for it signed by the CA in `work`."""
    (work / f"{name}.ext").write_text(extensions)
    _openssl(openssl, "req", "-new", *_new_key(work / f"{name}.key"),
             "-out", str(work / f"{name}.csr"), "-subj", f"/CN={common_name}")  # fmt: skip
    _openssl(openssl, "x509", "-req", "-in", str(work / f"{name}.csr"),
             "-CA", str(work / "ca.pem"), "-CAkey", str(work / "ca.key"),
             "-set_serial", str(secrets.randbits(63)), "-days", str(CERT_DAYS),
             "-extfile", str(work / f"{name}.ext"), "-out", str(work / f"{name}.crt"))  # fmt: skip
    os.chmod(work / f"{name}.key", 0o600)


def _openssl(openssl: str, *args: str) -> None:
    result = subprocess.run(
        [openssl, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise SecureError(f"openssl {args[0]} failed (exit {result.returncode}):\n{result.stderr}")


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner may read (keys, passwords)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
