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
# new build, an unchanged pin is never rebuilt. Builds run one at a time, niced, on
# GOMAXPROCS cores (default 2): the machines this runs on are small and shared.
#
#   deploy/tools/build.sh           build what is missing, then print `tool path` per tool
#   deploy/tools/build.sh --check   print `tool path`; exit 1 naming any tool not built yet
set -euo pipefail
cd "$(dirname "$0")"

CACHE=${TOKENBUS_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenbus/tools}
KEDA_VERSION=v2.21.0
export GOMAXPROCS=${GOMAXPROCS:-2} CGO_ENABLED=0 GOFLAGS=${GOFLAGS:--mod=mod}
mode=build
[ "${1:-}" = "--check" ] && mode=check

# <dir> <module>: the version of <module> that <dir>/go.mod requires.
pinned() {
  awk -v m="$2" '$1 == m { print $2; exit } $1 == "require" && $2 == m { print $3; exit }' "$1/go.mod"
}
# <dir> <module> <flags>: the pinned version and a hash of go.mod, go.sum and the build flags.
key() { echo "$(pinned "$1" "$2")-$({ cat "$1/go.mod" "$1/go.sum"; echo "$3"; } | sha256sum | cut -c1-12)"; }

missing=()
# <tool> <module> <package> [ldflags] [build tags]
tool() {
  local name=$1 module=$2 pkg=$3 ldflags=${4:-} tags=${5:-}
  local out
  out="$CACHE/$name/$(key "$name" "$module" "$ldflags $tags")/$name"
  if [ ! -x "$out" ] && [ "$mode" = build ]; then
    echo "build.sh: building $name ($pkg $(pinned "$name" "$module")), once…" >&2
    local started=$SECONDS
    mkdir -p "$(dirname "$out")"
    (cd "$name" && nice -n 19 go build -trimpath -tags "$tags" -ldflags "-s -w $ldflags" \
      -o "$out.tmp" "$pkg")
    mv "$out.tmp" "$out"
    echo "build.sh: $name built in $((SECONDS - started)) s" >&2
  fi
  if [ -x "$out" ]; then echo "$name $out"; else missing+=("$name"); fi
}

# KEDA's CRDs as its release tags them: only the YAML is needed, from the module's source.
crds="$CACHE/keda-crds/$KEDA_VERSION"
if [ ! -f "$crds/keda.sh_scaledobjects.yaml" ] && [ "$mode" = build ]; then
  echo "build.sh: fetching KEDA $KEDA_VERSION CRDs…" >&2
  dir=$(cd "$(mktemp -d)" && go mod download -json "github.com/kedacore/keda/v2@$KEDA_VERSION" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
  mkdir -p "$crds"
  cp "$dir"/config/crd/bases/*.yaml "$crds/"
  chmod u+w "$crds"/*.yaml
fi
if [ -f "$crds/keda.sh_scaledobjects.yaml" ]; then echo "keda-crds $crds"; else missing+=(keda-crds); fi

k8s=$(pinned kube-apiserver k8s.io/kubernetes)
minor=${k8s#v1.}
minor=${minor%%.*}
tool kustomize sigs.k8s.io/kustomize/kustomize/v5 sigs.k8s.io/kustomize/kustomize/v5
# Only the service discovery the configs here use (the cloud SDKs would triple the build).
tool promtool github.com/prometheus/prometheus github.com/prometheus/prometheus/cmd/promtool \
  "" remove_all_sd,enable_kubernetes_sd,enable_dns_sd
tool etcd go.etcd.io/etcd/server/v3 .
tool toxiproxy github.com/Shopify/toxiproxy/v2 github.com/Shopify/toxiproxy/v2/cmd/server \
  "-X github.com/Shopify/toxiproxy/v2.Version=$(pinned toxiproxy github.com/Shopify/toxiproxy/v2)"
tool kube-apiserver k8s.io/kubernetes k8s.io/kubernetes/cmd/kube-apiserver \
  "-X k8s.io/component-base/version.gitVersion=$k8s -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"

if [ ${#missing[@]} -gt 0 ]; then
  echo "build.sh: not built yet: ${missing[*]} (run deploy/tools/build.sh; ~15-30 min cold on 2 cores)" >&2
  exit 1
fi
