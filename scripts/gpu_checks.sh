#!/bin/bash
# What needs a CUDA GPU, in one go: the `gpu` tests (each with a CPU twin in the suite), then the step
# times of `distlab bench overhead` there. Writes under OUT (default runs/gpu): log.txt and the benches'
# JSON. Every part has its own time limit, so one that hangs cannot eat the others' time. DATA_DIR: where
# fashion-mnist's IDX files are (the mlp workload's data).
set -u
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/log.txt"; }
log "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
log "torch $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)')"
log "gpu tests"
timeout "${TESTS_S:-90}" python3 -m pytest -m gpu -q -n 4 -p no:cacheprovider tests/ > "$OUT/tests.txt" 2>&1
tail -25 "$OUT/tests.txt" >> "$OUT/log.txt"
log "GPT 12x768, T 1024, batch 16, bf16: plain, plain compiled, distlab, distlab --compile (the whole model)"
timeout "${LARGE_S:-220}" python3 -m distlab bench overhead --device cuda --workloads gpt-12x768 --precisions bf16 \
    --steps 60 --runs "${LARGE_RUNS:-3}" --compile --out "$OUT/gpt-12x768" >> "$OUT/log.txt" 2>&1
log "Llama 1B (16x2048, 32/8 heads, SwiGLU 8192), T 2048, batch 4, bf16, AdamW: both sides compiled"
timeout "${LLAMA_S:-360}" python3 -m distlab bench overhead --device cuda --workloads llama-1b --precisions bf16 \
    --steps 30 --runs "${LLAMA_RUNS:-2}" --compile --sides plain-compiled,distlab-compiled --out "$OUT/llama-1b" \
    >> "$OUT/log.txt" 2>&1
for precision in fp32 bf16; do
    log "small workloads, $precision"
    timeout "${SMALL_S:-75}" python3 -m distlab bench overhead --device cuda --workloads tiny,mlp,gpt \
        --precisions $precision --data-dir "${DATA_DIR:-.data}" --steps "${SMALL_STEPS:-1000}" --runs 3 \
        --out "$OUT/$precision" >> "$OUT/log.txt" 2>&1
done
log "done"
