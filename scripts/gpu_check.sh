#!/usr/bin/env bash
# The GPU check: one command for a lent GPU machine (about 8 minutes on one H200), everything under
# ${OUT:-runs/gpu}:
#   1. gpu.txt          what the machine is (nvidia-smi)
#   2. tests.log        the CUDA tests (tests/test_cuda.py) and the device-placement tests
#   3. profile/         a cost profile of Llama-3.1-8B verifying Llama-3.2-1B drafts (random init, bf16,
#                       configs/), batch sizes 1-64, contexts 128-8k: the replay env's input for this chip
#   4. policies/, profiles/, train.log   the default training chain on the GPU for the embedded pair (SmolLM2-135M,
#                       real weights, n-gram draft): its cost profile and train-split traces measured there (this
#                       dtype), the rules tuned, the warm start, PPO on the replay env, PPO on the real loop, the
#                       export and the evaluation against the best rule, at short budgets
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
  target_cfg=configs/tiny-target; draft_cfg=configs/tiny-draft
  profile_args=(--k-max 4 --context-lens 64,256 --repeats 1 --batch-sizes 1,2 --grid-context-lens 64,256)
  train_args=(--device cpu --quick)  # the chain keeps the committed CPU profile and traces (current), tunes, trains
  tests=(tests/test_placement.py)
else
  if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "error: no CUDA GPU visible here; scripts/gpu_check.sh --dry-run rehearses the steps on the CPU" >&2
    exit 2
  fi
  device=auto; dtype=bfloat16
  target_cfg=configs/llama-3.1-8b; draft_cfg=configs/llama-3.2-1b
  profile_args=(--k-max 8 --context-lens 128,512,2048,8192 --repeats 5 --batch-sizes 1,2,4,8,16,32,64
                --grid-context-lens 128,2048)  # the measured batch x context grid (~1 minute more)
  train_args=(--device auto --seed 0 --hp "batch_sizes=[1,4,16]" --hp "real_batch_sizes=[1,4]" --hp rollout_rounds=1
              --hp "rollout_episodes={1: 64, 4: 16, 16: 8}" --hp replay_timesteps=16384 --hp timesteps=2048
              --hp n_steps=512 --hp checkpoint_every=512 --eval-per-category 1 --eval-repeats 2)
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
step train "$out/train.log" "$py" scripts/train_policy.py --draft ngram --no-track --no-progress \
  --out "$out/policies" --profiles-out "$out/profiles" "${train_args[@]}"
policy=$(ls -d "$out"/policies/*/ngram-3 2>/dev/null | head -1)
step generate "$out/generate.json" "$py" scripts/generate.py --device "$device" --draft ngram \
  --policy "learned:${policy:-none}" --prompt "one two three one two three one two" --max-new-tokens 24 --json
echo "gpu check: exit $status; results in $out"
exit $status
