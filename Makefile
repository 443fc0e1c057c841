# specserve: `make setup` once, then `make test` / `make run` / `make bench`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# Every install takes the lock's versions (constraints.txt, `make lock`); torch is pinned in the same pip call so
# that a CPU machine takes the CPU wheel (a bare torch requirement pulls the multi-GB CUDA build).
LOCK := constraints.txt
TORCH := torch==2.13.0
# The models `make run` serves (deploy/local.yaml's target and draft); the suite also uses the small one.
SERVED_MODELS := qwen-1.5b qwen-0.5b
TEST_MODELS := smollm2-135m
export SPECSERVE_MODELS ?= $(HOME)/.cache/specserve/models
export SPECSERVE_HEADS ?= $(HOME)/.cache/specserve/heads

PROTO_STUBS := proto/specserve_pb2.py proto/specserve_pb2.pyi proto/specserve_pb2_grpc.py

.PHONY: setup setup-serve lock models serve-models heads test test-fast lint run bench proto k8s

setup:  ## install the package and its dev tools at the lock's versions
	$(PIP) install -q -c $(LOCK) "$(TORCH)" -e ".[dev]"
	$(MAKE) proto

# Serving alone: the package and its runtime dependencies, plus grpcio-tools, which writes the gRPC stubs of an
# editable checkout (`make proto`; a built package has its own) and is not imported at run time.
setup-serve:  ## install what `make run` needs (no dev tools) at the lock's versions
	$(PIP) install -q -c $(LOCK) "$(TORCH)" -e . grpcio-tools
	$(MAKE) proto

lock:  ## rewrite constraints.txt from this environment (after a dependency change, once the suite passes here)
	$(PYTHON) -m deploy.lock write

proto: $(PROTO_STUBS)  ## generate the gRPC stubs of proto/specserve.proto (git-ignored)

$(PROTO_STUBS) &: proto/specserve.proto
	$(PYTHON) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/specserve.proto

k8s:  ## k8s/rayservice.yaml's serveConfigV2 from deploy/cluster-gpu.yaml, k8s/grafana-dashboard.yaml's JSON from deploy/grafana/ (tests/unit/test_k8s.py checks they agree)
	$(PYTHON) -m deploy.k8s render

models: setup  ## fetch + convert the real models of docs/models.md (skipped when present)
	$(PYTHON) -m modelstore fetch $(SERVED_MODELS) $(TEST_MODELS)

serve-models: setup-serve  ## fetch + convert the models `make run` serves (skipped when present)
	$(PYTHON) -m modelstore fetch $(SERVED_MODELS)

# The unit tests start no Ray cluster and time nothing: they run first, on every core (pytest-xdist), one torch
# thread each, a module's tests on one worker (tests/unit/conftest.py) but the chi-square proofs of the acceptance
# rules (~14 CPU-minutes of single-threaded Python) spread test by test. Then the rest, whose Ray clusters, core
# placement and timed checks want the machine to themselves, with the unit modules that do too.
WHOLE_MACHINE_UNIT := tests/unit/test_bench_smoke.py tests/unit/test_cpu_cores.py tests/unit/test_kquant.py

test: models proto  ## the whole suite, as CI runs it
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q --timeout=1800 -n auto --dist loadgroup tests/unit \
		$(addprefix --ignore=,$(WHOLE_MACHINE_UNIT))
	$(PYTHON) -m pytest -q --timeout=1800 --durations=30 tests/actors tests/e2e tests/reliability $(WHOLE_MACHINE_UNIT)

test-fast: proto  ## unit tests only, no pretrained models
	$(PYTHON) -m pytest -q -m "not slow"

lint: proto
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy speculative actors deploy modelstore bench

run: serve-models  ## the server on embedded Ray with the default Qwen pair, answering one streamed request
	$(PYTHON) -m deploy.local.cli serve

# Medusa and EAGLE heads for the default target, trained here on its own outputs (speculative/train);
# skipped where already trained. About 30 + 30 minutes on 2 CPU cores, the data built once for both.
heads: models  ## train Medusa and EAGLE heads for qwen-1.5b into $SPECSERVE_HEADS (skipped when present)
	$(PYTHON) -m speculative.train medusa --target $(SPECSERVE_MODELS)/qwen-1.5b \
		--out $(SPECSERVE_HEADS)/qwen-1.5b-medusa --minutes 15 --skip-existing
	$(PYTHON) -m speculative.train eagle --target $(SPECSERVE_MODELS)/qwen-1.5b \
		--out $(SPECSERVE_HEADS)/qwen-1.5b-eagle --minutes 25 --skip-existing

bench: models heads
	$(PYTHON) -m bench.single_stream
