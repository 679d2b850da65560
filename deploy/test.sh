#!/usr/bin/env bash
# `make test`: the whole suite against a real Kafka. Starts a dedicated local broker unless
# KAFKA_BOOTSTRAP_SERVERS names one, always stops what it started, and fails when pytest
# collects nothing (exit 5): a suite that runs no test proves nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
TEST_PORT=39092
TEST_STATE=.tokenbus/test-kafka

# Tools the tests and the local broker run; installed only when missing (root in CI).
missing=()
command -v kcat >/dev/null || missing+=(kcat)
# The secured-broker tests make their CA and certificates with openssl.
command -v openssl >/dev/null || missing+=(openssl)
# The chat page is tested in a real headless browser (Debian's, driven by chromedriver).
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)
if [ -z "${KAFKA_BOOTSTRAP_SERVERS:-}" ]; then
  command -v java >/dev/null || missing+=(default-jre-headless)
  command -v mvn >/dev/null || missing+=(maven)
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]}…"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The manifest and monitoring checks run real tools (kustomize, kube-apiserver, etcd,
# promtool, KEDA's CRDs): built from the Go module proxy once, then cached by version.
deploy/tools/build.sh >/dev/null

if [ -z "${KAFKA_BOOTSTRAP_SERVERS:-}" ]; then
  # Its own port and state dir: a `make run` broker on 9092 is neither used nor stopped.
  trap '"$PY" -m deploy.kafka.launcher stop --state-dir "$TEST_STATE"' EXIT
  "$PY" -m deploy.kafka.launcher start --port "$TEST_PORT" --state-dir "$TEST_STATE"
  export KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:$TEST_PORT"
fi

status=0
# The chaos check runs with `make chaos`: it passes most runs, but two races it found are
# still open (docs/reliability.md), and a CI run must not hinge on them.
"$PY" -m pytest -q -m "not chaos" "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure" >&2
fi
exit "$status"
