#!/usr/bin/env bash
# The real tools the manifest, monitoring and chaos checks run (tests/test_k8s*.py,
# tests/test_monitoring*.py, tests/chaos/), built from the Go module proxy once and cached by
# version:
#
#   kube-apiserver  k8s.io/kubernetes/cmd/kube-apiserver   (kube-apiserver/go.mod)
#   etcd            go.etcd.io/etcd/server/v3/etcdmain      (etcd/go.mod, main.go)
#   promtool        github.com/prometheus/prometheus/cmd/promtool (promtool/go.mod)
#   kustomize       sigs.k8s.io/kustomize/kustomize/v5      (kustomize/go.mod)
#   toxiproxy       github.com/Shopify/toxiproxy/v2/cmd/server (toxiproxy/go.mod; the chaos
#                   check's network faults, tests/chaos/toxiproxy.py)
#   keda-crds       github.com/kedacore/keda/v2 config/crd/bases/ (downloaded, not built)
#
# Each lands in $TOKENBUS_TOOLS_DIR (default ~/.cache/tokenbus/tools)/<tool>/<key>/, where the
# key is the pinned version plus a hash of that tool's go.mod and go.sum: a version bump is a
# new build, an unchanged pin is never rebuilt. Builds run niced, on GOMAXPROCS cores
# (default 2): the machines this runs on are small and shared. One build.sh builds a tool at a
# time, holding that tool's lock (<tool>/.lock); another build.sh that needs the same tool
# waits on the lock and then finds it built. `make test` (deploy/test.sh) runs the plain form
# in the background while the tests run, and a test that needs a tool runs `--only` for it
# (tests/built_tools.py), so it waits for that build or does it. The tools are built in the
# order the suite first needs them: toxiproxy (tests/chaos/, collected first), KEDA's CRDs and
# kustomize (tests/test_k8s.py), etcd and kube-apiserver (tests/test_k8s_apiserver.py),
# promtool (tests/test_monitoring*.py).
#
#   deploy/tools/build.sh              build what is missing, then print `tool path` per tool
#   deploy/tools/build.sh --check      print `tool path`; exit 1 naming any tool not built yet
#   deploy/tools/build.sh --only TOOL  build TOOL (or wait for the build under way), print its path
set -euo pipefail
cd "$(dirname "$0")"

CACHE=${TOKENBUS_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenbus/tools}
KEDA_VERSION=v2.21.0
export GOMAXPROCS=${GOMAXPROCS:-2} CGO_ENABLED=0 GOFLAGS=${GOFLAGS:--mod=mod}

usage() {
  echo "build.sh: $1" >&2
  echo "usage: deploy/tools/build.sh [--check] [--only TOOL]" >&2
  exit 2
}
mode=build
only=""
while [ $# -gt 0 ]; do
  case $1 in
    --check) mode=check ;;
    --only)
      if [ $# -lt 2 ] || [ -z "$2" ]; then usage "--only needs a tool's name"; fi
      only=$2
      shift
      ;;
    *) usage "unknown argument: $1" ;;
  esac
  shift
done

# <dir> <module>: the version of <module> that <dir>/go.mod requires.
pinned() {
  awk -v m="$2" '$1 == m { print $2; exit } $1 == "require" && $2 == m { print $3; exit }' "$1/go.mod"
}
# <dir> <module> <flags>: the pinned version and a hash of go.mod, go.sum and the build flags.
key() { echo "$(pinned "$1" "$2")-$({ cat "$1/go.mod" "$1/go.sum"; echo "$3"; } | sha256sum | cut -c1-12)"; }

# <tool> <command...>: run the command holding the tool's lock. The command checks again
# whether the tool is there: one that waited finds it built by the holder, and builds nothing.
# Its status is the command's; a tool that fails to build is reported missing at the end, and
# the tools after it are still built. (Called where `set -e` does not reach, so the build
# steps check each command themselves.)
locked() {
  local name=$1
  shift
  mkdir -p "$CACHE/$name"
  (
    if ! flock -n 9; then
      echo "build.sh: waiting for the $name build that another build.sh is running" \
        "(lock $CACHE/$name/.lock)…" >&2
      flock 9 || exit 1
    fi
    "$@"
  ) 9>"$CACHE/$name/.lock"
}

names=()
missing=()
# <tool> <out>: report the tool: its path (--only) or `tool path`, else count it missing.
found() {
  if [ -e "$2" ]; then
    if [ -n "$only" ]; then echo "$2"; else echo "$1 $2"; fi
  else
    missing+=("$1")
  fi
}
# <tool>: whether this run is about the tool (every tool, or the one --only names).
wanted() {
  names+=("$1")
  [ -z "$only" ] || [ "$only" = "$1" ]
}

need_go() {
  command -v go >/dev/null || { echo "build.sh: $1 needs Go 1.24+ (https://go.dev/dl/)" >&2; return 1; }
}

# <out> <tool> <package> <ldflags> <build tags>, under the tool's lock.
go_build() {
  local out=$1 name=$2 pkg=$3 ldflags=$4 tags=$5 started=$SECONDS
  [ ! -x "$out" ] || return 0
  need_go "$name" || return 1
  echo "build.sh: building $name ($pkg, $(basename "$(dirname "$out")")), once…" >&2
  mkdir -p "$(dirname "$out")" &&
    (cd "$name" && nice -n 19 go build -trimpath -tags "$tags" -ldflags "-s -w $ldflags" \
      -o "$out.tmp" "$pkg") &&
    mv "$out.tmp" "$out" || return 1
  echo "build.sh: $name built in $((SECONDS - started)) s" >&2
}

# <tool> <module> <package> [ldflags] [build tags]
tool() {
  local name=$1 module=$2 pkg=$3 ldflags=${4:-} tags=${5:-}
  wanted "$name" || return 0
  local out
  out="$CACHE/$name/$(key "$name" "$module" "$ldflags $tags")/$name"
  if [ ! -x "$out" ] && [ "$mode" = build ]; then
    locked "$name" go_build "$out" "$name" "$pkg" "$ldflags" "$tags" || true
  fi
  if [ -x "$out" ]; then found "$name" "$out"; else missing+=("$name"); fi
}

# KEDA's CRDs as its release tags them: only the YAML is needed, from the module's source.
# Copied beside, then renamed into place (over what a broken run left): a reader sees every
# file or none.
crds="$CACHE/keda-crds/$KEDA_VERSION"
fetch_crds() {
  [ ! -f "$crds/keda.sh_scaledobjects.yaml" ] || return 0
  need_go keda-crds || return 1
  echo "build.sh: fetching KEDA $KEDA_VERSION CRDs…" >&2
  local started=$SECONDS dir
  dir=$(cd "$(mktemp -d)" && go mod download -json "github.com/kedacore/keda/v2@$KEDA_VERSION" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])') || return 1
  rm -rf "$crds.tmp" && mkdir -p "$crds.tmp" &&
    cp "$dir"/config/crd/bases/*.yaml "$crds.tmp/" &&
    chmod u+w "$crds.tmp"/*.yaml &&
    rm -rf "$crds" && mv "$crds.tmp" "$crds" || return 1
  echo "build.sh: keda-crds fetched in $((SECONDS - started)) s" >&2
}

k8s=$(pinned kube-apiserver k8s.io/kubernetes)
minor=${k8s#v1.}
minor=${minor%%.*}
# The order the suite first needs them in (see the top).
tool toxiproxy github.com/Shopify/toxiproxy/v2 github.com/Shopify/toxiproxy/v2/cmd/server \
  "-X github.com/Shopify/toxiproxy/v2.Version=$(pinned toxiproxy github.com/Shopify/toxiproxy/v2)"
if wanted keda-crds; then
  [ -f "$crds/keda.sh_scaledobjects.yaml" ] || [ "$mode" = check ] || locked keda-crds fetch_crds || true
  if [ -f "$crds/keda.sh_scaledobjects.yaml" ]; then found keda-crds "$crds"; else missing+=(keda-crds); fi
fi
tool kustomize sigs.k8s.io/kustomize/kustomize/v5 sigs.k8s.io/kustomize/kustomize/v5
tool etcd go.etcd.io/etcd/server/v3 .
tool kube-apiserver k8s.io/kubernetes k8s.io/kubernetes/cmd/kube-apiserver \
  "-X k8s.io/component-base/version.gitVersion=$k8s -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
# Only the service discovery the configs here use (the cloud SDKs would triple the build).
tool promtool github.com/prometheus/prometheus github.com/prometheus/prometheus/cmd/promtool \
  "" remove_all_sd,enable_kubernetes_sd,enable_dns_sd

if [ -n "$only" ] && [[ " ${names[*]} " != *" $only "* ]]; then
  usage "no tool named $only; the tools: ${names[*]}"
fi
if [ ${#missing[@]} -gt 0 ] && [ "$mode" = check ]; then
  echo "build.sh: not built yet: ${missing[*]} (run deploy/tools/build.sh; ~15-30 min cold on 2 cores)" >&2
  exit 1
elif [ ${#missing[@]} -gt 0 ]; then
  echo "build.sh: could not build: ${missing[*]} (the errors above)" >&2
  exit 1
fi
