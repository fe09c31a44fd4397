# The README's two commands. Each first sets up .venv with the pinned stack for this machine (scripts/setup.sh;
# instant when it is already there, plus a 2-s check that torch sees the GPU on a GPU machine;
# POSTTRAIN_CPU=1 make demo takes the CPU stack on any machine).
#   make demo   run the main job on the built-in model and data
#   make test   run the test suite (scripts/test.sh; two tiers and the GPU tier where CUDA is visible)
PY := .venv/bin/python

.PHONY: setup demo test
setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) grpo.py

test: setup
	@bash scripts/test.sh
