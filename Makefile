# tokenbridge — every target does its own setup; `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV    := .venv
PY      := $(VENV)/bin/python
SETUP   := $(VENV)/.stamp-setup
ART     := artifacts
MODELS  := $(ART)/.stamp-models

# shipped defaults: the real pair and the shipped corpus
TEACHER ?= $(ART)/models/gemma-3-270m
STUDENT ?= $(ART)/models/smollm2-135m
DATA    ?= $(ART)/corpus/shakespeare/*.txt
K       ?= 8
OUT     ?=
TASKS   ?=
LIMIT   ?=
MODEL   ?=
BENCH   ?=
RUNS    ?= runs/demo
DIR     ?=
URL     ?=
ALIGN_ARGS ?=
SHARDS  ?= outputs/align/demo
CACHE_ARGS ?=
# K is the projection's k (8) unless given; the teacher cache's own default is 32 (xtoken's k)
CACHE_K = $(if $(filter command line environment,$(origin K)),$(K),32)

export PYTHONUNBUFFERED := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: help setup models test lint format demo science demo-onpolicy demo-onpolicy-compare debug onpolicy-debug projection align teacher-cache verify upload-model wheel train eval report bench gpu-check gpu-check-pack teacher-server teacher-server-stop clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

# torch 2.13.0: the CUDA build where nvidia-smi lists a GPU, else the CPU build
# (tokenbridge/assets/torch_build.py; TORCH_BUILD=cpu|cuda overrides the detection)
TORCH_BUILD ?= auto
setup: $(SETUP)  ## create .venv with the pinned dependencies (idempotent; TORCH_BUILD=cpu|cuda)
$(SETUP): pyproject.toml requirements.lock requirements-cuda.lock
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	torch_args=$$($(VENV)/bin/python tokenbridge/assets/torch_build.py --device $(TORCH_BUILD)) && \
	  $(VENV)/bin/pip install -q -c requirements.lock $$torch_args -e '.[dev]'
	touch $@

models: $(SETUP)  ## fetch + convert teacher/student, tokenizer fixtures, corpora, eval data into artifacts/
	$(PY) -m tokenbridge.assets all
	$(PY) -m trainer.eval.datasets fetch

lint: $(SETUP)  ## ruff lint + format check
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(SETUP)  ## ruff autoformat
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# the served teacher's virtualenv (see teacher-server below); defined before the rules that need it
VLLM_STAMP := .venv-vllm/.stamp-lock

# Two pytest-xdist workers: run in one process, the suite keeps about one core busy
# (single-threaded Python, one process waiting on another). A file is one unit of work
# (tests/conftest.py says which files share a server or a launch); TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: $(SETUP) $(VENV)/.stamp-bench $(VLLM_STAMP) models lint  ## the whole test suite, from a fresh clone (TEST_WORKERS=2)
	$(PY) -m pytest -n $(TEST_WORKERS) tests

projection: models  ## sparse vocabulary projection TEACHER -> STUDENT (K=, OUT=)
	$(PY) -m pipelines.projection --teacher $(TEACHER) --student $(STUDENT) --k $(K) $(if $(OUT),--out $(OUT))

align: models  ## Beam job: DATA glob -> aligned Arrow shards (TEACHER= (several ok), STUDENT=, OUT=, ALIGN_ARGS=)
	$(PY) -m pipelines.align --data '$(DATA)' $(foreach t,$(TEACHER),--teacher $(t)) --student $(STUDENT) $(if $(OUT),--out $(OUT)) $(ALIGN_ARGS)

verify: $(SETUP)  ## checksums (+ values) of DIR=<shards | cache | checkpoint(s) | run dir>; exit 2 on damage
	$(PY) -m tokenbridge.commands.verify $(DIR)

upload-model: $(SETUP)  ## mark DIR= (a model or tokenizer directory: every file's checksum) and upload it to URL=
	$(PY) -m tokenbridge.commands.verify --mark $(DIR) --upload $(URL)

wheel: $(SETUP)  ## dist/tokenbridge-*.whl, for the Beam SDK container (docker/beam-sdk.Dockerfile)
	$(VENV)/bin/pip wheel -q --no-deps --no-build-isolation -w dist .

teacher-cache: models  ## Beam job: score SHARDS= with TEACHER= once, for teachers[i].cache (K=32, OUT=, CACHE_ARGS=)
	$(PY) -m pipelines.teacher_cache --shards $(SHARDS) --teacher $(TEACHER) --k $(CACHE_K) $(if $(OUT),--out $(OUT)) $(CACHE_ARGS)

# a teacher served by vLLM, from its own virtualenv (vLLM pins another transformers): MODEL=<HF
# dir> PORT= K=. The stamp holds the lock's hash (tokenbridge.commands.teacher_server); `make
# test` makes the venv before pytest starts, so that no test installs anything.
$(VLLM_STAMP): requirements-vllm.lock requirements-vllm-cuda.lock | $(SETUP)
	$(PY) -m tokenbridge.commands.teacher_server venv
	touch $@

PORT ?= 8100
teacher-server: $(SETUP) $(VLLM_STAMP)  ## serve MODEL=<dir> with vLLM on 127.0.0.1:PORT (K=: max prompt log-probs), print its URL
	$(PY) -m tokenbridge.commands.teacher_server start --model $(MODEL) --port $(PORT) $(if $(filter command line environment,$(origin K)),--k $(K))

teacher-server-stop:  ## stop the teacher server on PORT
	$(PY) -m tokenbridge.commands.teacher_server stop --port $(PORT)

train: models  ## one-process training run on the demo config (see README for torchrun)
	$(PY) trainer/main.py conf=demo

eval: models  ## evaluation suite: MODEL=a[,b] TASKS= LIMIT=
	$(PY) -m trainer.eval --model '$(MODEL)' $(if $(TASKS),--tasks $(TASKS)) $(if $(LIMIT),--limit $(LIMIT))

report: $(SETUP)  ## run report (HTML + PNGs) of RUNS=runs/a [runs/b ...], side by side
	$(PY) -m trainer.report $(RUNS)

DEMO_ALIGN := outputs/align/demo
DEMO_DATA  := $(ART)/corpus/kjv_letters.jsonl
# the CE-only twin of conf=demo: same student, shards, steps, optimizer and seed, no teacher
DEMO_CE    := name=demo_ce loss=ce teachers=none checkpoint.save_at_end=false
demo: models  ## the main job on the shipped default (real Gemma-3-270M -> SmolLM2-135M, CPU), vs CE-only
	@date +%s > .demo-start
	@echo "== 1/5 tokenizer pair report"
	$(PY) -m tokenbridge.commands.pair_report $(TEACHER) $(STUDENT)
	@echo "== 2/5 sparse vocabulary projection (Gemma -> SmolLM2)"
	$(PY) -m pipelines.projection --teacher $(TEACHER) --student $(STUDENT) --k 8
	@echo "== 3/5 align the KJV letters (one document per chapter) into shards (Beam, FnApiRunner)"
	$(PY) -m pipelines.align --data $(DEMO_DATA) --teacher $(TEACHER) --student $(STUDENT) \
	  --out $(DEMO_ALIGN) --overwrite --max-student-tokens 256 --max-teacher-tokens 256
	@echo "== 4/5 distil SmolLM2-135M from Gemma-3-270M (xtoken + CE), bits/byte before and after"
	rm -rf runs/demo runs/demo_ce
	$(PY) trainer/main.py conf=demo
	@echo "== 5/5 the same run without the teacher (CE only: same steps, data, optimizer)"
	$(PY) trainer/main.py conf=demo $(DEMO_CE) parallel.threads=2
	@echo "== distillation vs CE-only vs the teacher"
	$(PY) -m trainer.report.compare "distilled (xtoken + CE)=runs/demo" "CE only=runs/demo_ce" \
	  --out runs/demo/compare.md
	@echo "== run report (plots, open in a browser): runs/demo/report/report.html"
	@echo "== make demo took $$(( $$(date +%s) - $$(cat .demo-start) )) s"; rm -f .demo-start

# bench-only baselines (TRL's aligner and ULD loss), installed without their heavy deps
BENCH_DEPS := trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19 pandas==3.1.1 dill==0.4.1
$(VENV)/.stamp-bench: $(SETUP)
	$(VENV)/bin/pip install -q --no-deps $(BENCH_DEPS)
	touch $@

bench: models $(VENV)/.stamp-bench $(VLLM_STAMP)  ## run the benchmarks and write BENCHMARKS.md (BENCH=name to run one; ALLOW_LOAD=1 on a busy machine)
	$(PY) -m bench.run_all $(BENCH) $(if $(ALLOW_LOAD),--allow-load)

# A GPU machine has its own Python (with torch and transformers) and no .venv: use whichever is
# here. Neither target sets anything up: the check needs no weights (docs/gpu.md).
GPU_PY := $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:  ## GPU check, <= 6 min on one H100/H200, no weights or network (docs/gpu.md; OUT=dir)
	$(GPU_PY) -m bench.gpu.check $(if $(OUT),--out $(OUT))

gpu-check-pack: models  ## .gpucheck/: tokenizers, text, Hydra for a GPU machine without them (docs/gpu.md)
	$(PY) -m bench.gpu.pack

science: models $(VENV)/.stamp-bench  ## the science table: every loss mode vs CE-only vs TRL's GOLD (docs/science.md)
	$(PY) -m bench.science.experiment

KJV_ALIGN := outputs/align/kjv
demo-onpolicy: models  ## on-policy distillation, real pair on CPU: SmolLM2 samples KJV continuations, Gemma scores
	$(PY) -m pipelines.projection --teacher $(TEACHER) --student $(STUDENT) --k 8
	test -f $(KJV_ALIGN)/COMPLETED || $(PY) -m pipelines.align --data $(ART)/corpus/kjv.jsonl \
	  --teacher $(TEACHER) --student $(STUDENT) --out $(KJV_ALIGN) --overwrite \
	  --max-student-tokens 128 --max-teacher-tokens 128
	rm -rf runs/onpolicy_demo
	$(PY) trainer/main.py conf=onpolicy_demo

demo-onpolicy-compare: models  ## on-policy vs off-policy KD vs CE-only, same wall-clock (after demo-onpolicy's inputs)
	rm -rf runs/onpolicy_compare
	$(PY) -m bench.onpolicy.equal_budget

# the tiny-model experiments: the real tokenizers, random weights, seconds of training on CPU.
# Shards are made once (delete the directory to remake them); their windows fit the config's
# data.max_student_tokens (tests/unit/test_conf_commands.py checks every conf header's commands)
DEBUG_ALIGN := outputs/align/debug
debug: models  ## conf=debug: xtoken distillation with tiny models, CPU (makes its projection + shards)
	$(PY) -m pipelines.projection --teacher $(TEACHER) --student $(STUDENT) --k 8
	test -f $(DEBUG_ALIGN)/COMPLETED || $(PY) -m pipelines.align --data '$(DATA)' \
	  --teacher $(TEACHER) --student $(STUDENT) --out $(DEBUG_ALIGN) --overwrite \
	  --max-student-tokens 512 --max-teacher-tokens 512
	rm -rf runs/debug
	$(PY) trainer/main.py conf=debug

ONPOLICY_DEBUG_ALIGN := outputs/align/onpolicy_debug
onpolicy-debug: models  ## conf=onpolicy_debug: on-policy distillation with tiny models, CPU (makes its inputs)
	$(PY) -m pipelines.projection --teacher $(TEACHER) --student $(STUDENT) --k 8
	test -f $(ONPOLICY_DEBUG_ALIGN)/COMPLETED || $(PY) -m pipelines.align --data '$(DATA)' \
	  --teacher $(TEACHER) --teacher $(STUDENT) --student $(STUDENT) \
	  --out $(ONPOLICY_DEBUG_ALIGN) --overwrite --max-student-tokens 64 --max-teacher-tokens 64
	rm -rf runs/onpolicy_debug
	$(PY) trainer/main.py conf=onpolicy_debug

clean:  ## remove run outputs (keeps .venv and artifacts/)
	rm -rf outputs runs .pytest_cache .ruff_cache
