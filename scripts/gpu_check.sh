#!/usr/bin/env bash
# The GPU check: one command for a lent GPU machine (about 8 minutes on one H200), everything under
# ${OUT:-runs/gpu}:
#   1. gpu.txt          what the machine is (nvidia-smi)
#   2. tests.log        the CUDA tests (tests/test_cuda.py) and the device-placement tests
#   3. profile/         a cost profile of Llama-3.1-8B verifying Llama-3.2-1B drafts (random init, bf16,
#                       configs/), batch sizes 1-64, contexts 128-8k: the replay env's input for this chip
#   4. policies/, train.log   a short real-loop PPO training on the GPU (random-init small target, n-gram
#                       draft), its export and its evaluation
#   5. generate.json    the exported policy (LearnedK) deciding k on the GPU
# --dry-run rehearses the same steps on the CPU with tiny shapes (the test suite runs it). Without a GPU
# and without --dry-run it stops at once. Steps run on after a failure; the exit code is the first failure's.
set -uo pipefail
dry=0
case "${1:-}" in
  --dry-run) dry=1 ;;
  "") ;;
  *) echo "usage: scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
out=${OUT:-runs/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
if [ "$dry" = 1 ]; then
  device=cpu; dtype=float32
  target_cfg=configs/tiny-target; draft_cfg=configs/tiny-draft; train_target=random:configs/tiny-target
  profile_args=(--k-max 4 --context-lens 64,256 --repeats 1 --batch-sizes 1,2 --grid-context-lens 64,256)
  train_args=(--timesteps 64 --hp n_steps=32 --hp batch_size=16 --hp n_epochs=1 --hp checkpoint_every=32
              --hp max_new_tokens=12 --hp k_max=4 --hp "real_batch_sizes=[1,2]" --eval-max-new-tokens 8)
  tests=(tests/test_placement.py)
else
  if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "error: no CUDA GPU visible here; scripts/gpu_check.sh --dry-run rehearses the steps on the CPU" >&2
    exit 2
  fi
  device=auto; dtype=bfloat16
  target_cfg=configs/llama-3.1-8b; draft_cfg=configs/llama-3.2-1b; train_target=random:configs/small-target
  profile_args=(--k-max 8 --context-lens 128,512,2048,8192 --repeats 5 --batch-sizes 1,2,4,8,16,32,64
                --grid-context-lens 128,2048)  # the measured batch x context grid (~1 minute more)
  train_args=(--timesteps 1024 --hp n_steps=256 --hp checkpoint_every=256 --hp max_new_tokens=64
              --hp "real_batch_sizes=[1,4,16]" --eval-max-new-tokens 32)
  tests=(tests/test_cuda.py tests/test_placement.py tests/test_devices.py)
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv > "$out/gpu.txt" 2>&1
fi
status=0
step() {  # step NAME LOG COMMAND...: run, log, remember the first failure
  local name=$1 log=$2; shift 2
  local t0=$SECONDS
  "$@" > "$log" 2>&1
  local rc=$?
  echo "$name: exit $rc, $((SECONDS - t0)) s (log: $log)"
  if [ $rc -ne 0 ] && [ $status -eq 0 ]; then status=$rc; tail -5 "$log" >&2; fi
}
step tests "$out/tests.log" "$py" -m pytest -q -p no:cacheprovider "${tests[@]}"
step profile "$out/profile.log" "$py" scripts/profile_device.py --device "$device" --target-config "$target_cfg" \
  --draft-config "$draft_cfg" --dtype "$dtype" --no-traces --no-progress --out "$out/profile" "${profile_args[@]}"
step train "$out/train.log" "$py" scripts/train_policy.py --device "$device" --target "$train_target" --draft ngram \
  --env real --seed 0 --no-track --no-progress --out "$out/policies" --eval-per-category 1 "${train_args[@]}"
policy=$(ls -d "$out"/policies/*/ngram-3 2>/dev/null | head -1)
step generate "$out/generate.json" "$py" scripts/generate.py --device "$device" --target "$train_target" --draft ngram \
  --policy "learned:${policy:-none}" --prompt "one two three one two three one two" --max-new-tokens 24 --json
echo "gpu check: exit $status; results in $out"
exit $status
