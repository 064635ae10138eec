"""Peak memory of a run on a memory-mapped corpus (``--dataset tokens:DIR``): a token file of several
GB against a small one, the same model, steps and layout. A corpus that were read whole would add
its size to every rank's resident memory; a mapped one adds only the pages its batches touched.

    python scripts/mapped_corpus_memory.py --gb 2.2 --out results/mapped-corpus

makes SCRATCH/big (the large corpus: random tokens, made once; ``--scratch``, default
/tmp/distlab-mapped-corpus) and SCRATCH/small, and writes one run directory per corpus and
OUT/memory.json: a record per corpus with its size and its run's peak RSS and peak anonymous memory
(the largest over its ranks, from its summary.json): RSS counts the mapped corpus's pages the kernel
keeps cached (and drops under pressure), anonymous memory only what the run allocated itself. Prepared with distlab's own writer (the manifest and checksums
``prepare-text`` writes); random tokens, since what is measured is the reading, not the text.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distlab.data import prepare as prep, tokens  # noqa: E402

VOCAB = 256


def make_corpus(out: Path, train_tokens: int, test_tokens: int, seed: int = 0) -> dict:
    """A prepared corpus of random byte tokens (its manifest as prepare-text writes one)."""
    if (out / "manifest.json").exists():
        return json.loads((out / "manifest.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    dtype = prep.dtype_for(VOCAB)
    splits = {}
    for split, n in (("train", train_tokens), ("test", test_tokens)):
        writer = prep.SplitWriter(out / f"{split}.bin", dtype, VOCAB)
        writer.documents = 1
        chunk = 1 << 26
        for start in range(0, n, chunk):
            writer.write(rng.integers(0, VOCAB, min(chunk, n - start), dtype=np.uint16), min(chunk, n - start))
        splits[split] = writer.close()
        if split == "train":
            entropy = prep.unigram_entropy(writer.counts)
    manifest = {"format": tokens.FORMAT, "source": "random bytes (scripts/mapped_corpus_memory.py)",
                "tokenizer": "bytes", "vocab_size": VOCAB, "dtype": dtype.name, "test_every": tokens.TEST_EVERY,
                "splits": splits, "unigram_entropy": entropy}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def run(corpus: Path, out: Path, args) -> dict:
    cmd = [sys.executable, "-m", "distlab", "train", "--nproc-per-node", str(args.nproc), "--model", "gpt", "--dataset", f"tokens:{corpus}",
           "--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--block-size", str(args.block_size),
           "--global-batch-size", "16", "--max-steps", str(args.steps), "--eval-batches", "2",
           "--eval-batch-size", "16", "--log-every", "5", "--no-progress", "--out", str(out)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    summary = json.loads((out / "summary.json").read_text())
    return {"peak_rss_mb": summary["peak_rss_mb"], "peak_anon_rss_mb": summary["peak_anon_rss_mb"],
            "steps": summary["steps"], "wall_s": time.perf_counter() - t0,
            "time_per_step_s_median": summary["time_per_step_s_median"], "windows": summary["steps_per_epoch"]
            * summary["global_batch_size"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=2.2, help="Size of the large corpus's training file (GB).")
    p.add_argument("--out", default="results/mapped-corpus")
    p.add_argument("--scratch", default="/tmp/distlab-mapped-corpus", help="Where the corpora are made (kept).")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--block-size", type=int, default=256)
    args = p.parse_args()
    out = Path(args.out)
    big_tokens = int(args.gb * 1e9) // 2
    sizes = {"big": big_tokens, "small": 1 << 20}
    records = []
    for name, n in sizes.items():
        manifest = make_corpus(Path(args.scratch) / name, n, 1 << 16)
        records.append({"corpus": name, "train_file_bytes": manifest["splits"]["train"]["tokens"] * 2,
                        **run(Path(args.scratch) / name, out / f"run-{name}", args), "nproc": args.nproc,
                        "block_size": args.block_size, "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d")})
        print(f"{name}: {records[-1]['train_file_bytes'] / 1e9:.2f} GB of tokens, peak RSS "
              f"{records[-1]['peak_rss_mb']:.0f} MB per rank (largest), of it anonymous "
              f"{records[-1]['peak_anon_rss_mb']:.0f} MB", flush=True)
    (out / "memory.json").write_text(json.dumps(records, indent=1) + "\n")
    print(f"difference: {records[0]['peak_rss_mb'] - records[1]['peak_rss_mb']:+.0f} MB RSS, "
          f"{records[0]['peak_anon_rss_mb'] - records[1]['peak_anon_rss_mb']:+.0f} MB anonymous for "
          f"{(records[0]['train_file_bytes'] - records[1]['train_file_bytes']) / 1e9:.2f} GB more corpus; wrote "
          f"{out / 'memory.json'} (distlab bench markdown renders it)")


if __name__ == "__main__":
    main()
