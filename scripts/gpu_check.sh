#!/usr/bin/env bash
# The one-shot GPU check (issues 30, 48): seven parts in order of value, each under `timeout`,
# each writing its own JSON under OUT as it finishes, all within 9 minutes on an H100 (the slower
# of the two GPUs a lent machine has: a 510 s budget for the parts, after a few seconds' import
# check; the first H200 runs took 333 s for the seven parts, bench/results/gpu-h200/summary.json).
# The budget cuts the last parts first: the per-step figures and the 8B detection come first.
#   bash scripts/gpu_check.sh [OUT_DIR]             a lent GPU (default OUT: $OUT, else ./gpu-results)
#   bash scripts/gpu_check.sh --dry-run OUT_DIR     CI: the same parts on CPU tensors, small shapes
#                                                   (also GPU_CHECK_DRY_RUN=1), in under 2 minutes
# Nothing is installed and torch is never pinned: the project runs from PYTHONPATH with the
# machine's Python ($PYTHON, else /opt/torch/.venv/bin/python, else python3; the dry run prefers
# .venv/bin/python), which needs torch, numpy, numba, xxhash, safetensors and transformers; no
# vLLM, no zstandard, no internet. A part that fails or hangs costs only itself: every part runs,
# OUT/summary.json lists each one's exit status and time, and the script exits non-zero if any
# part failed.
# One file carries everything: OUT/results.tgz (every part's JSON and log, summary.json, log,
# nvidia-smi.txt), rewritten after each part, so a run cut short still leaves an archive. Where
# only a few files come back from the machine (8 from a lent one, the first by name, and
# "gpu_*" sorts before "results.tgz"), put the archive alone in the folder that comes back:
#   GPU_CHECK_ARCHIVE="$OUT/results.tgz" bash scripts/gpu_check.sh /tmp/gpu-check
# Parts (modules under bench/, each with --device and --small), in order, with their caps on the
# GPU (about 1.6x the H200's measured wall, process start and exit included, for an H100):
#   1 gpu          140 s  bench.gpu: 0.6B and 1.7B shapes, `ctx`, 3 steps after a warm-up (87 s)
#   2 gpu_detect   110 s  trainer change detection, 8B shape, 0.5/3/15/50 % + the host path
#                         once (70 s, before the compacted detection of issue 48)
#   3 gpu_commit    55 s  8B stand-in replica, ~6 GB free: commits of 1/3/10 % deltas (34 s)
#   4 gpu_graphs    45 s  CUDA graph + torch.compile harness, commits between replays,
#                         inference_mode (26-28 s)
#   5 gpu_special   20 s  special values, CPU against device bf16 conversion (5 s; the cap is
#                         Python, torch and CUDA start-up on a cold machine)
#   6 gpu_digest    75 s  the full-state digest at the 8B shape (45 s and more; only process
#                         exit, releasing the CUDA context with over 32 GB cached, runs after the
#                         JSON is written)
#   7 gpu_fsdp     100 s  FSDP2 world size 1 through the sharded publish (64 s)
set -uo pipefail
cd "$(dirname "$0")/.."
dry="${GPU_CHECK_DRY_RUN:-0}"
if [ "${1:-}" = "--dry-run" ]; then
  dry=1
  shift
fi
out="${1:-${OUT:-gpu-results}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
archive="${GPU_CHECK_ARCHIVE:-$out/results.tgz}"
mkdir -p "$(dirname "$archive")"
archive="$(cd "$(dirname "$archive")" && pwd)/$(basename "$archive")"
rm -f "$out/summary.json" "$archive"
: > "$out/log"
if [ "$dry" = 1 ]; then
  py="${PYTHON:-.venv/bin/python}"
  flags=(--device cpu --small)
  budget=115 # seconds for all parts together
else
  py="${PYTHON:-/opt/torch/.venv/bin/python}"
  flags=(--device cuda)
  budget=510 # 9 minutes with start-up and the archive; the caps add up to more: the last part
  # gives way on a slow machine
fi
[ -x "$py" ] || py=python3
case "$py" in */* ) py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")" ;; esac # archive cds
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$py" -c "import torch, numba, xxhash, safetensors, transformers
print('torch', torch.__version__, 'on',
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')" \
  2>&1 | tee -a "$out/log"
[ "$dry" = 1 ] || nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true

start=$SECONDS
failed=0
summary=""
done_parts=()
# archive: OUT/results.tgz (or $GPU_CHECK_ARCHIVE) with every file written so far, replaced whole.
archive() {
  local files=() f tmp
  tmp="$(dirname "$archive")/.tmp-$(basename "$archive")" # keeps the .tgz ending (compression)
  for f in "${done_parts[@]/%/.json}" "${done_parts[@]/%/.log}" summary.json log nvidia-smi.txt; do
    [ -f "$out/$f" ] && files+=("$f")
  done
  if (cd "$out" && tar -czf "$tmp" "${files[@]}" 2>/dev/null \
    || "$py" -m tarfile -c "$tmp" "${files[@]}"); then
    mv -f "$tmp" "$archive"
  else
    rm -f "$tmp"
    echo "== could not write $archive" | tee -a "$out/log"
  fi
}
# run_part NAME CAP_SECONDS MODULE [ARGS...]: at most CAP seconds, and never past the budget.
run_part() {
  local name=$1 cap=$2 module=$3
  shift 3
  local left=$((budget - (SECONDS - start)))
  local limit=$((cap < left ? cap : left))
  local t0=$SECONDS rc
  rm -f "$out/$name.json"
  if [ "$limit" -lt 5 ]; then
    rc=125
    echo "== $name: skipped, no time left in the ${budget} s budget" | tee -a "$out/log"
  else
    echo "== $name ($module, at most ${limit} s)" | tee -a "$out/log"
    timeout -k 5 "$limit" "$py" -m "$module" "${flags[@]}" "$@" --json "$out/$name.json" \
      2>&1 | tee -a "$out/log" > "$out/$name.log"
    rc=$?
  fi
  if [ ! -s "$out/$name.json" ]; then # killed before its first write: a stub says why
    printf '{"part": "%s", "ok": false, "complete": false, "rc": %d, "error": "%s"}\n' \
      "$name" "$rc" "exit status $rc (124: timed out after ${limit} s; 125: not run)" \
      > "$out/$name.json"
  fi
  [ "$rc" -eq 0 ] || failed=1
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/log"
  summary="$summary${summary:+, }\"$name\": {\"rc\": $rc, \"wall_s\": $((SECONDS - t0))}"
  done_parts+=("$name")
  archive
}

if [ "$dry" = 1 ]; then # 2-9 s a part on 2 cores; caps allow a shared host 5x slower
  run_part gpu 45 bench.gpu
  run_part gpu_detect 30 bench.gpu_detect
  run_part gpu_commit 30 bench.gpu_commit
  run_part gpu_graphs 30 bench.gpu_graphs --versions 2
  run_part gpu_special 20 bench.gpu_special
  run_part gpu_digest 30 bench.gpu_digest
  run_part gpu_fsdp 30 bench.gpu_fsdp
else
  run_part gpu 140 bench.gpu
  run_part gpu_detect 110 bench.gpu_detect
  run_part gpu_commit 55 bench.gpu_commit
  run_part gpu_graphs 45 bench.gpu_graphs
  run_part gpu_special 20 bench.gpu_special
  run_part gpu_digest 75 bench.gpu_digest
  run_part gpu_fsdp 100 bench.gpu_fsdp
fi
echo "{\"dry_run\": $([ "$dry" = 1 ] && echo true || echo false), \"failed\": $failed," \
  "\"wall_s\": $((SECONDS - start)), \"parts\": {$summary}}" > "$out/summary.json"
cat "$out/summary.json" | tee -a "$out/log"
archive
[ ! -f "$archive" ] || echo "== everything in $archive"
exit "$failed"
