"""The files and functions of distlab one training step runs through (docs/ARCHITECTURE.md lists them).

    python scripts/step_route.py [STRATEGY] [--model gpt] [--nproc N]

The real Trainer trains a small model (verify's: an MLP on synthetic images, or ``--model gpt``) on N
gloo ranks; rank 0 records, with ``sys.setprofile``, every distlab function entered from the end of
step 3 to the end of step 4 -- one whole step of the loop: the next batch, the forward and backward,
the gradient sync, the optimizer step, the bookkeeping (no log line, evaluation or snapshot falls in
it). Prints the files in the order they were first entered, with their functions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIRST, LAST = 3, 4  # record from the end of this step to the end of the next


def _route(rank: int, world: int, cfg):
    from distlab import runtime
    from distlab.train import Trainer
    seen: dict[str, list[str]] = {}
    package = ROOT / "distlab"

    def profile(frame, event, arg):
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if package in path.parents:
                names = seen.setdefault(str(path.relative_to(ROOT)), [])
                if frame.f_code.co_name not in names:
                    names.append(frame.f_code.co_name)

    def hook(step: int) -> None:
        if rank == 0 and step == FIRST:
            sys.setprofile(profile)
        elif step == LAST:
            sys.setprofile(None)

    Trainer(cfg, runtime.from_process_group(), hooks=[hook]).fit()
    return seen if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("strategy", nargs="?", default="bucketed")
    ap.add_argument("--model", default=None, choices=("gpt", "gpt-moe"))
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import dataclasses

    from distlab.launch.spawn import run_ranks
    from distlab.tools.verify import Case, config_for, parse_strategy
    case = parse_strategy(args.strategy)
    case = Case(case.strategy, case.optimizer, args.model or case.model)
    cfg = dataclasses.replace(config_for(case, args.nproc, steps=LAST + 2), log_every=100)
    seen = run_ranks(_route, args.nproc, cfg, timeout=300)[0]
    functions = sum(len(v) for v in seen.values())
    print(f"{args.strategy} ({cfg.model}, {args.nproc} ranks): one step crosses {len(seen)} files, {functions} functions")
    for path, names in seen.items():
        print(f"  {path}: {', '.join(names)}")


if __name__ == "__main__":
    main()
