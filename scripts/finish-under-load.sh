#!/usr/bin/env bash
# Many short 2-rank runs while CPU hogs load every core: how many end with a nonzero exit code?
# (A finished run must exit 0 whatever gloo's teardown does.)  Usage: scripts/finish-under-load.sh [RUNS]
set -u
runs=${1:-40}
bin=${DISTLAB:-.venv/bin/distlab}
work=$(mktemp -d -t distlab-finish-XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq "$(nproc)"); do python3 -c 'while True: pass' & done
failed=0
for i in $(seq "$runs"); do
    if ! "$bin" train --nproc-per-node 2 --dataset synthetic:1x8x8:4:64 --mlp-widths 8 --max-steps 2 \
            --global-batch-size 8 --no-progress --out "$work/run$i" >"$work/log$i" 2>&1; then
        failed=$((failed + 1)); echo "run $i failed:"; tail -3 "$work/log$i"
    fi
done
echo "$runs runs under $(nproc) CPU hogs on $(nproc) cores: $failed failed"
[ "$failed" = 0 ]
