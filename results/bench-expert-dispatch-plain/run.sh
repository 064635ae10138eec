cd results/bench-expert-dispatch-plain
for round in 1 2 3; do
  for d in all_to_all all_gather; do
    distlab train --model gpt-moe --dataset fortunes --block-size 256 --n-layer 2 --n-embd 128 --n-head 4 --experts 8 --top-k 2 --global-batch-size 16 --max-steps 10 --nproc-per-node 2 --ep 2 --ep-dispatch $d --no-progress --out $d-round$round > $d-round$round.log 2>&1
  done
done
echo done > finished
