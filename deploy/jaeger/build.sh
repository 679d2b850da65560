#!/usr/bin/env bash
# Builds the Jaeger (v2) all-in-one binary from the Go module proxy, once per version, into a
# cache shared by every checkout: ${TOKENBUS_CACHE:-~/.cache/tokenbus}/jaeger/<version>/jaeger.
# Prints the binary's path on stdout. Jaeger's go.mod has replace directives, so
# `go install pkg@version` refuses it; it is built as a tool of a throw-away module instead.
# Several callers at once (make test starts it in the background, the test waits for it):
# one builds, the others wait on the lock and find the binary.
set -euo pipefail
VERSION="${JAEGER_VERSION:-v1.76.0}"
CACHE="${TOKENBUS_CACHE:-$HOME/.cache/tokenbus}/jaeger/$VERSION"
BIN="$CACHE/jaeger"
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
command -v go >/dev/null || { echo "jaeger build: needs Go 1.24+ (https://go.dev/dl/)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
started=$(date +%s)
echo "jaeger build: $VERSION from the Go module proxy (minutes, once; log: $CACHE/build.log)" >&2
(
  cd "$work"
  go mod init tokenbus.local/jaeger-build
  go get -tool "github.com/jaegertracing/jaeger/cmd/jaeger@$VERSION"
  go build -trimpath -o "$work/jaeger" github.com/jaegertracing/jaeger/cmd/jaeger
) >"$CACHE/build.log" 2>&1 || { tail -20 "$CACHE/build.log" >&2; exit 1; }
mv "$work/jaeger" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
echo "jaeger build: done in $(( $(date +%s) - started )) s" >&2
echo "$BIN"
