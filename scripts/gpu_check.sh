#!/usr/bin/env bash
# The GPU checks, as one short script for a lent GPU machine (see the device tool): the CUDA tests,
# then a cost profile of Llama-3.1-8B verifying Llama-3.2-1B drafts (random-init bf16, no weights),
# over batch sizes 1..32 too (where speculation should stop paying on a GPU: the BatchTableK input).
# Results land in ${OUT:-runs/gpu}. Needs torch with CUDA and transformers; gymnasium/SB3 are not used.
set -uo pipefail
out=${OUT:-runs/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log"
python3 scripts/profile_device.py --device auto --target-config configs/llama-3.1-8b \
    --draft-config configs/llama-3.2-1b --dtype bfloat16 --k-max 8 --context-lens 128,1024,4096 \
    --repeats 7 --batch-sizes 1,2,4,8,16,32 --no-traces --no-progress --out "$out" 2>&1 | tee "$out/profile.log"
