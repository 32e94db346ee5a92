# prolip_jax: `make test` (what CI runs) and `make demo` (train + evaluate a small ProLIP on CPU).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
# tests/conftest.py sets XLA_FLAGS (eight fake CPU devices, so sharding tests run anywhere;
# LLVM -O0, the older fusion emitters) when unset: a caller's own XLA_FLAGS are dropped here.
TEST_ENV := env -u XLA_FLAGS JAX_PLATFORMS=cpu
# pytest-xdist processes, a test file each at a time: CI's machine has 2 cores.
TEST_WORKERS ?= 2

.PHONY: install test test-torch demo clean

# The stamp is rebuilt when the dependency lists change. pip compiles the installed packages'
# bytecode on one core; compileall does it on all of them (half the install's time on 2 cores).
$(VENV)/.installed: setup.cfg pyproject.toml requirements/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile -c requirements/constraints.txt -e '.[dev,eval]'
	$(PY) -m compileall -q -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))') > /dev/null
	touch $@

install: $(VENV)/.installed

# A pytest worker that dies (a crash in XLA) fails the run at once: pytest-xdist 3.8's
# replacement worker can wait forever under --dist loadfile (pytest-dev/pytest-xdist#784, #1323).
# A test still running after 15 minutes prints every thread's stack (it does not stop it).
# The project's bytecode is compiled once first: the suite starts ~100 Python processes, and
# where PYTHONDONTWRITEBYTECODE is set each would compile every module it imports again.
test: $(VENV)/.installed
	$(PY) -m compileall -q prolip_jax input_pipeline evaluators scripts benchmarks configs > /dev/null
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0 -o faulthandler_timeout=900 --durations=25 tests

# Optional: PyTorch round-trip tests (CPU wheel), skipped by `make test` when torch is absent.
test-torch: $(VENV)/.installed
	$(PY) -m pip install -q -c requirements/constraints.txt torch==2.13.0
	$(TEST_ENV) $(PY) -m pytest -q tests -k torch

# The demo: dataset (cached in ~/.cache/prolip_jax or $$PROLIP_JAX_CACHE), training, evaluation,
# summary table. Rerunning resumes an interrupted run and reuses finished stages.
DEMO_WORKDIR ?= workdirs/demo
DEMO_ENV     ?= JAX_PLATFORMS=cpu
demo: $(VENV)/.installed
	$(DEMO_ENV) $(PY) scripts/demo.py --workdir $(DEMO_WORKDIR)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
