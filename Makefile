# MOSS-VL on Ascend NPU — developer entry points. `make help` lists them.
SHELL := /bin/bash
PYTHON_BASE ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.setup-done
# CPU runs only: the import-only sgl_kernel stand-in and sglang's CPU engine switch.
# PD disaggregation's transfer engine (mooncake) loads libibverbs.so.1: Debian's libibverbs1, installed by apt as root,
# else unpacked into the venv (VENDOR_LIB, on the library path of every CPU run).
VENDOR_LIB := $(CURDIR)/$(VENV)/debian/usr/lib/x86_64-linux-gnu
CPU_ENV := SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=$(CURDIR)/cpu_shim HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
	LD_LIBRARY_PATH=$(VENDOR_LIB)$(if $(LD_LIBRARY_PATH),:$(LD_LIBRARY_PATH))
PORT ?= 30000
DEVICE ?= cpu
ARGS ?=
PYTEST_ARGS ?=

.PHONY: help setup chromium lint test test-fast catalog demo demo-realtime demo-realtime-web serve eval tiny-model bench bench-serving bench-realtime bench-realtime-engine bench-graphs soak-realtime serve-fleet serve-pd bench-fleet clean

help: ## list the targets with what each does
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

setup: $(STAMP) chromium ## create .venv: torch 2.14.1 (local wheels), sglang 0.5.23 --no-deps, CPU runtime deps, the plugin; Debian's chromium

# The realtime page's browser tests drive Debian's chromium (playwright with executable_path, never its own browser
# download); installed here where we are root with apt-get, else the tests fail and say so.
chromium: ## install Debian's chromium where root and apt-get allow it (the realtime page's browser tests)
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; } || \
	  echo "setup: chromium not installed (needs root and apt-get): install Debian's chromium package for the browser tests"

$(STAMP): requirements-sglang-runtime.txt requirements-test.txt sglang/pyproject.toml
	test -x $(PY) || $(PYTHON_BASE) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.14.1 torchvision==0.29.1
	$(PIP) install -q --no-deps sglang==0.5.23
	$(PIP) install -q -r requirements-sglang-runtime.txt -r requirements-test.txt -c constraints-torch.txt
	$(PIP) install -q --no-deps -e sglang/
	/sbin/ldconfig -p | grep -q 'libibverbs.so.1 ' || test -e $(VENDOR_LIB)/libibverbs.so.1 || \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -q libibverbs1; \
	  else mkdir -p $(VENV)/debian && cd $(VENV)/debian && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200 \
	    && for deb in *.deb; do dpkg -x $$deb .; done && cp -an lib/x86_64-linux-gnu/. usr/lib/x86_64-linux-gnu/; fi
	LD_LIBRARY_PATH=$(VENDOR_LIB) $(PY) -c "import mooncake.engine"
	$(PY) -c "import sglang, torch; assert sglang.__version__ == '0.5.23', sglang.__version__; print('sglang', sglang.__version__, 'torch', torch.__version__)"
	touch $@

tiny-model: setup ## build (or reuse) the tiny random-weight MOSS-VL checkpoint; prints its directory last
	$(CPU_ENV) $(PY) -m moss_vl_reference.tiny_checkpoint

# Two pytest-xdist workers, a module (or a group of modules sharing servers) each at a time, in the order
# tests/conftest.py sets (longest first); TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)

test: setup lint ## lint, then run the whole CPU test suite on TEST_WORKERS=2 workers (PYTEST_ARGS= adds pytest options)
	$(CPU_ENV) $(PY) -m pytest tests -q $(XDIST) $(PYTEST_ARGS)

test-fast: setup ## the tests that start no server (-m "not served": no sglang server, engine or runner --serve), no lint
	$(CPU_ENV) $(PY) -m pytest tests -q -m "not served" $(XDIST) $(PYTEST_ARGS)

lint: setup ## ruff lint and format check over the whole tree (configuration: pyproject.toml)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

catalog: setup ## regenerate sglang/PATCHES.md from the plugin's patch records (a test fails when it is stale)
	$(CPU_ENV) $(PY) -m mossvl_ascend.catalog > sglang/PATCHES.md

demo: setup ## serve the embedded tiny MOSS-VL with sglang + plugin, ask about assets/demo.png, stop the server
	$(CPU_ENV) $(PY) -m serving.demo

demo-realtime: setup ## serve the tiny MOSS-VL-Realtime, stream a video through WS /v1/video/realtime with a prompt, print the rounds, stop
	$(CPU_ENV) $(PY) -m serving.realtime_demo

demo-realtime-web: setup ## serve the tiny MOSS-VL-Realtime on 127.0.0.1:$(PORT) and print the realtime page's address (camera, screen or a video file in the browser); Ctrl-C stops
	$(CPU_ENV) $(PY) -m serving.realtime_web_demo --port $(PORT)

MODEL ?= $(shell $(CPU_ENV) $(PY) -m moss_vl_reference.tiny_checkpoint 2>/dev/null | tail -n 1)
# serving.launch adds the CPU engine settings and --sleep-on-idle on DEVICE=cpu (and a core split per rank for
# --tp-size/--dp-size > 1), then execs python -m sglang.launch_server ... --host 127.0.0.1 --trust-remote-code --enable-multimodal.
# The local directories a request may name media in (file:// or a path; the server reads no other local file):
# MOSSVL_ALLOWED_LOCAL_MEDIA_PATH when set, else the repository's example media.
MEDIA_DIRS ?= $(or $(MOSSVL_ALLOWED_LOCAL_MEDIA_PATH),$(CURDIR)/inference/examples/media:$(CURDIR)/assets)
serve: setup ## foreground server on 127.0.0.1:$(PORT); override MODEL=, DEVICE=, PORT=, ARGS= (e.g. ARGS="--tp-size 2"), MEDIA_DIRS=
	MOSSVL_ALLOWED_LOCAL_MEDIA_PATH=$(MEDIA_DIRS) $(PY) -m serving.launch --model-path $(MODEL) --device $(DEVICE) --port $(PORT) $(ARGS)

eval: setup ## VideoMME-shaped set through the OpenAI API as lmms-eval sends it (own server), vs the transformers runner; ARGS= adds options
	$(CPU_ENV) $(PY) -m serving.evaluate $(ARGS)

bench: setup ## attention benchmarks: cross-attention (dense mask vs boundaries vs floor, per dtype), then batched core vs per-request loop
	$(CPU_ENV) $(PY) benchmarks/bench_cross_attention.py
	$(CPU_ENV) $(PY) benchmarks/bench_native_attention.py

bench-serving: setup ## sglang bench_serving (c=1, c=8) vs the reference model one by one, bench preset on CPU (~15 min)
	$(CPU_ENV) $(PY) -m benchmarks.bench_serving $(ARGS)

bench-realtime: setup ## reference realtime stream: step time at frame 10 and 200 (tiny, bench) vs the old per-prompt re-encode
	$(CPU_ENV) $(PY) benchmarks/bench_realtime_reference.py

WORKERS ?= 2
POLICY ?= cache_aware
serve-fleet: setup ## WORKERS= CPU workers (one core share each) behind smg on 127.0.0.1:$(PORT) (POLICY=cache_aware|round_robin, ARGS= to every worker); Ctrl-C stops all
	$(PY) -m serving.fleet --model-path $(MODEL) --device $(DEVICE) --port $(PORT) --workers $(WORKERS) --policy $(POLICY) $(ARGS)

serve-pd: setup ## one prefill and one decode CPU worker (KV over Mooncake TCP) behind smg in PD mode on 127.0.0.1:$(PORT) (ARGS= to both workers); Ctrl-C stops all
	LD_LIBRARY_PATH=$(VENDOR_LIB) $(PY) -m serving.fleet --pd --model-path $(MODEL) --device $(DEVICE) --port $(PORT) $(ARGS)

bench-fleet: setup ## 1 vs 2 CPU workers behind smg: image chat req/s, realtime sessions at 1 fps, cache_aware vs round_robin cached tokens, ejection (~5 min)
	$(CPU_ENV) $(PY) benchmarks/bench_fleet.py $(ARGS)

bench-graphs: setup ## decode graphs vs eager on CPU (--enable-torch-compile): TPOT at batch 1, 8, 16, capture time, host ops per step (~10 min)
	$(CPU_ENV) $(PY) benchmarks/bench_decode_graphs.py $(ARGS)

bench-realtime-engine: setup ## realtime sessions served by sglang (1-8 sessions, 1 and 2 fps) beside the transformers session
	$(CPU_ENV) $(PY) benchmarks/bench_realtime.py $(ARGS)

MINUTES ?= 20
soak-realtime: setup ## MINUTES= (default 20) of 4 realtime sessions at 1 fps, frame window on, questions, barge-ins, a drop; ARGS= adds options
	$(CPU_ENV) $(PY) benchmarks/soak_realtime.py --minutes $(MINUTES) $(ARGS)

clean: ## remove the venv and built artefacts
	rm -rf $(VENV) build
