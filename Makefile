# Terra: `make demo` sets everything up and runs the main example; `make test` runs the test suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow bench bench-quick clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Two test processes (pytest-xdist): the suite takes about half the time on 2 cores, and every
# run is also a run on a busy machine. `pytest` alone, as in development, runs serially.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --durations=25

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) -m benchmarks.run
	$(PY) -m benchmarks.real
	$(PY) -m benchmarks.fit
	$(PY) -m benchmarks.soak
	$(PY) -m benchmarks.breakdown
	$(PY) -m benchmarks.ratio

bench-quick: $(STAMP)
	$(PY) -m benchmarks.run --quick

clean:
	rm -rf $(VENV) build *.egg-info

.PHONY: bench-coexec bench-pipeline bench-ada-grouper bench-real bench-fit bench-soak bench-breakdown bench-ratio bench-limits bench-latency results
bench-coexec: $(STAMP)
	$(PY) -m benchmarks.coexec

bench-real: $(STAMP)
	$(PY) -m benchmarks.real

bench-fit: $(STAMP)
	$(PY) -m benchmarks.fit

bench-soak: $(STAMP)
	$(PY) -m benchmarks.soak

bench-breakdown: $(STAMP)
	$(PY) -m benchmarks.breakdown

bench-ratio: $(STAMP)
	$(PY) -m benchmarks.ratio

bench-limits: $(STAMP)
	$(PY) -m benchmarks.limits

bench-latency: $(STAMP)
	$(PY) -m benchmarks.latency

bench-pipeline: $(STAMP)
	$(PY) benchmarks/pipeline.py

bench-ada-grouper: $(STAMP)
	$(PY) benchmarks/ada_grouper.py

results: $(STAMP)
	$(PY) -m benchmarks.collect
