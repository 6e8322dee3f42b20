# Two entry points, both safe on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU machines get the CPU torch wheel (a bare `torch` can pull a multi-GB CUDA build).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch>=2.11" || echo "torch==2.13.0")
STAMP := $(VENV)/.killick-installed

.PHONY: demo test setup clean bench-bw

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py Makefile native/build.py $(wildcard native/src/*.cpp native/src/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel pybind11
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q --no-build-isolation -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m proxy.cli demo

# pytest-xdist workers, each taking a whole file at a time (module fixtures built once); 1 runs them in turn
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile tests

bench-bw: $(STAMP)
	$(PY) -m proxy.cli bench bw

clean:
	rm -rf $(VENV) build *.egg-info native/*.so
