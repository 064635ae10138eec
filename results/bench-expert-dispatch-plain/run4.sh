cd results/bench-expert-dispatch-plain
for d in all_to_all all_gather; do
  distlab train --model gpt-moe --dataset fortunes --block-size 256 --n-layer 2 --n-embd 128 --n-head 4 --experts 8 --top-k 2 --global-batch-size 16 --max-steps 10 --nproc-per-node 4 --threads 1 --ep 4 --ep-dispatch $d --no-progress --out ep4-$d > ep4-$d.log 2>&1
done
echo done > finished4
