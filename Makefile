# Developer entry points: setup, test, serve, lint, k8s-crds, clean.
# Everything runs from the project venv in .venv; `make setup` is idempotent and re-installs
# only when pyproject.toml changes (stamp file .venv/.installed).

SHELL := /bin/bash
.DEFAULT_GOAL := setup

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
STAMP := $(VENV)/.installed

# CPU-only torch wheel pinned exactly: with an exact pin and the local wheel folder, uv prefers
# the local 2.13.0+cpu build; without them it resolves the multi-GB CUDA build from PyPI.
CPU_TORCH ?= torch==2.13.0
# uv reads neither pip.conf nor PIP_FIND_LINKS, so pass each folder explicitly (may be empty).
FIND_LINKS := $(foreach d,$(PIP_FIND_LINKS),--find-links "$(d)")

# Keep Ray on loopback, without token auth or telemetry (see design/environment.md §3).
RAY_ENV := RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
# Triton kernels run in the interpreter on CPU torch tensors.
TEST_ENV := $(RAY_ENV) TRITON_INTERPRET=1

PYTEST_MARKERS ?= not gpu and not slow
PYTEST_ARGS ?=
# pytest-xdist processes (0: none, in-process). Two on CI's two cores: test-all 1215 s -> 859 s
# (each worker a Ray cluster of its own, the Ray and the CPU-bound interpreter tests mixed; one
# worker for every Ray test, --dist loadgroup, took 946 s)
TEST_WORKERS ?= 2
PYTEST_XDIST = -n $(TEST_WORKERS) --dist load
MODEL ?=
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

# The KubeRay release the manifests in k8s/ are written for (README, "Deploying on Kubernetes")
# and where `make k8s-crds` puts its CRDs for scripts/validate_k8s.py (git-ignored).
KUBERAY_VERSION := v1.7.0
KUBERAY_CRDS ?= .k8s-crds
KUBERAY_CRD_URL ?= https://raw.githubusercontent.com/ray-project/kuberay/$(KUBERAY_VERSION)/helm-chart/kuberay-operator/crds
KUBERAY_CRD_FILES := ray.io_rayclusters.yaml ray.io_rayjobs.yaml ray.io_rayservices.yaml

.PHONY: setup test test-all serve lint k8s-crds clean distclean

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# --compile-bytecode: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE is set
# (CI) every process (pytest, each Ray worker and Serve replica) would compile torch, Ray and
# transformers from source again: ~270 s of the CPU suite
$(STAMP): pyproject.toml | $(PY)
	@[ -x $(UV) ] || $(PY) -m pip install -q --disable-pip-version-check uv
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		echo "setup: CUDA machine, letting torch resolve"; \
		$(UV) pip install --python $(PY) --compile-bytecode -e '.[dev]'; \
	else \
		echo "setup: no nvidia-smi, installing CPU torch"; \
		$(UV) pip install --python $(PY) --compile-bytecode $(FIND_LINKS) $(CPU_TORCH) \
			-e '.[dev,triton]'; \
	fi
	@touch $@

test: setup
	$(TEST_ENV) $(PY) -m pytest -q -m "$(PYTEST_MARKERS)" $(PYTEST_XDIST) $(PYTEST_ARGS)

# Everything that runs without a GPU, the `slow` tier included (what CI runs).
test-all: setup
	$(TEST_ENV) $(PY) -m pytest -q -m "not gpu" $(PYTEST_XDIST) $(PYTEST_ARGS)

# Blocks serving the OpenAI API on http://$(HOST):$(PORT)/v1 until Ctrl-C.
serve: setup
	$(RAY_ENV) $(VENV)/bin/glm53 serve $(if $(MODEL),--model "$(MODEL)",) \
		--host $(HOST) --port $(PORT) $(SERVE_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

# Fetches the pinned KubeRay release's CRDs (all three or none) for scripts/validate_k8s.py,
# which reads them when ../shared/k8s-crds/ does not exist.
k8s-crds:
	rm -rf $(KUBERAY_CRDS).part && mkdir -p $(KUBERAY_CRDS).part
	for f in $(KUBERAY_CRD_FILES); do \
		curl -fsSL "$(KUBERAY_CRD_URL)/$$f" -o "$(KUBERAY_CRDS).part/$$f" || exit 1; \
	done
	rm -rf $(KUBERAY_CRDS) && mv $(KUBERAY_CRDS).part $(KUBERAY_CRDS)
	@echo "k8s-crds: KubeRay $(KUBERAY_VERSION) CRDs in $(KUBERAY_CRDS)/"

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .ci/logs
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -exec rm -rf {} +

# Also drops the venv; the next `make setup` rebuilds it.
distclean: clean
	rm -rf $(VENV)
