#!/bin/bash
# The planner against a measured step on one GPU, in one go: the GPU's own rates (`plan calibrate --device`),
# distlab's step of the Llama 3.2 1B shape trained eager and compiled (time per step, peak allocated memory),
# the plan of the same run at the documented default efficiency and at the measured rates, and each error
# (OUT/single-gpu-check.json, a table in OUT/log.txt). Every part has its own time limit.
#   OUT      where everything goes (default runs/gpu-plan)
#   DEVICE   cuda (default), or cpu to try the commands out at a small MODEL
#   MACHINE  the plan's machine (default: h200 or h100-sxm, from the GPU's name)
#   MODEL    the model's flags, as train and plan take them (default: Llama 3.2 1B's shape: 16 x 2048, 32/8 heads,
#            SwiGLU 8192, tied embeddings, 128,256 tokens); RATES the model whose layers calibrate times (default
#            --preset llama3.2-1b: the same shapes)
#   BLOCK BATCH STEPS   window, global batch, steps (default 2048, 4, 30)
set -u
OUT=${OUT:-runs/gpu-plan}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:---model llama --n-layer 16 --n-head 32 --kv-heads 8 --n-embd 2048 --ffn-hidden 8192 --rope-theta 500000 --tie-embeddings true --vocab-size 128256}
RATES=${RATES:---preset llama3.2-1b}
BLOCK=${BLOCK:-2048} BATCH=${BATCH:-4} STEPS=${STEPS:-30}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/log.txt"; }
if [ -z "${MACHINE:-}" ]; then
    case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
        *H200*) MACHINE=h200 ;; *H100*) MACHINE=h100-sxm ;; *A100*) MACHINE=a100-80g ;; *B200*) MACHINE=b200 ;;
        *) echo "no known GPU here: give MACHINE (h200, h100-sxm, a100-80g, b200)"; exit 2 ;;
    esac
fi
RUN="$MODEL --block-size $BLOCK --dataset synthetic-text:4000000 --global-batch-size $BATCH --optimizer adamw --precision bf16"
log "$MACHINE, $DEVICE: rates of the layers of $RATES at $BLOCK tokens"
# shellcheck disable=SC2086
timeout "${RATES_S:-120}" python3 -m distlab plan calibrate --device "$DEVICE" $RATES --block-size "$BLOCK" \
    -o "$OUT/plan-rates.json" >> "$OUT/log.txt" 2>&1
for mode in eager compiled; do
    log "train, $mode, $STEPS steps"
    # shellcheck disable=SC2086
    timeout "${TRAIN_S:-180}" python3 -m distlab train $RUN --lr 3e-4 --weight-decay 0.1 --device "$DEVICE" --max-steps "$STEPS" --seed 0 \
        $([ $mode = compiled ] && echo --compile) --out "$OUT/$mode" >> "$OUT/log.txt" 2>&1
done
for rates in default measured; do
    log "plan at the $rates rates"
    # shellcheck disable=SC2086
    timeout "${PLAN_S:-60}" python3 -m distlab plan $RUN --machine "$MACHINE" --gpus 1 --json "$OUT/plan-$rates.json" \
        $([ $rates = measured ] && echo --calibration "$OUT/plan-rates.json") >> "$OUT/log.txt" 2>&1
done
log "compare"
python3 - "$OUT" "$MACHINE" <<'EOF' 2>&1 | tee -a "$OUT/log.txt"
import json, sys
from pathlib import Path
out, machine = Path(sys.argv[1]), sys.argv[2]
rows, plans = [], {}
for rates in ("default", "measured"):
    p = out / f"plan-{rates}.json"
    if p.exists():
        plan = json.loads(p.read_text())
        plans[rates] = plan[0] if isinstance(plan, list) else plan
    else:
        print(f"plan at the {rates} rates: none ({p}): see log.txt")
for mode in ("eager", "compiled"):
    s = out / mode / "summary.json"
    if not s.exists():
        print(f"{mode}: no summary ({s}): see log.txt"); continue
    run = json.loads(s.read_text())
    for rates, plan in plans.items():
        step, mem = run["time_per_step_s_median"], (run.get("peak_cuda_mb") or 0) * 2**20
        rows.append({"run": mode, "rates": rates, "machine": machine, "measured_step_s": step,
                     "predicted_step_s": plan["step_s"], "step_error": plan["step_s"] / step - 1,
                     "measured_peak_bytes": mem or None, "predicted_memory_bytes": plan["memory_bytes_per_rank"],
                     "memory_error": plan["memory_bytes_per_rank"] / mem - 1 if mem else None,
                     "measured_mfu": run.get("mfu"), "device": run.get("device"), "torch": run.get("torch_version")})
(out / "single-gpu-check.json").write_text(json.dumps(rows, indent=1) + "\n")
print(f"{'run':9} {'rates':9} {'step measured':>14} {'predicted':>10} {'error':>7} {'peak measured':>14} {'predicted':>10} {'error':>7}")
for r in rows:
    mem = f"{r['measured_peak_bytes'] / 2**30:11.2f} GiB" if r["measured_peak_bytes"] else f"{'-':>14}"
    err = f"{r['memory_error']:+7.1%}" if r["memory_error"] is not None else f"{'-':>7}"
    print(f"{r['run']:9} {r['rates']:9} {r['measured_step_s'] * 1e3:11.1f} ms {r['predicted_step_s'] * 1e3:7.1f} ms "
          f"{r['step_error']:+7.1%} {mem} {r['predicted_memory_bytes'] / 2**30:6.2f} GiB {err}")
EOF
log "done"
