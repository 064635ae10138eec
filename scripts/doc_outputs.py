"""Output blocks in docs/ and the commands that print them.

A fenced block preceded by ``<!-- output of: COMMAND -->`` shows what COMMAND prints. This module
finds those blocks, runs their commands and says where a page and its command disagree, so a page
never shows output the code no longer produces. ``tests/test_examples.py`` checks every block.

A block is a pattern, not a transcript. In it:

* a line ``...`` stands for any number of output lines, ``...`` inside a line for any text;
* runs of spaces match any run of spaces;
* times (``4.48 ms``, ``2,980 samples/s``, ``efficiency 0.13``, ``+7%``) match any number, since
  they are this machine's;
* float32 round-off (``1.5e-08``: any number written with an exponent of -5 or below, or
  ``0.0e+00``) matches any other round-off, since it depends on the CPU's kernels;
* counts of threads and cores (``x 1 threads``, ``on 2 cores``) match any count: a run's default
  threads are the machine's cores divided among its ranks.

Every other character -- byte counts, parameter counts, ranks, losses printed as fixed text -- must
be what the command prints.

    python scripts/doc_outputs.py             # run every marked command, print the disagreements
    python scripts/doc_outputs.py docs/01-collectives.md --write   # rewrite blocks with no wildcards
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r"^<!-- output of: (.+?) -->\s*$")
_NUM = r"[-+]?\d[\d,]*(?:\.\d+)?"
_TIMES = [  # (what a page shows, what it matches)
    (re.compile(rf"{_NUM}(?= ?ms\b)"), _NUM),
    (re.compile(rf"{_NUM}(?= samples/s)"), _NUM),
    (re.compile(rf"(?<=efficiency ){_NUM}"), _NUM),
    (re.compile(r"[-+]\d+(?:\.\d+)?%"), r"[-+]\d+(?:\.\d+)?%"),
    (re.compile(r"\d\.\d+e-(?:0[5-9]|[1-9]\d)|0\.0e\+00"), r"(?:\d\.\d+e-(?:0[5-9]|[1-9]\d)|0\.0e\+00)"),
    (re.compile(r"\d+ threads?\b"), r"\d+ threads?"),  # threads per rank follow the machine's cores (1 thread, 4 threads)
    (re.compile(r"\d+(?= cores\b)"), r"\d+"),
]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int        # 1-based line of the opening fence
    command: str
    text: str

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        m = MARK.match(line)
        if not m:
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise ValueError(f"{page}:{i + 1}: an output marker must be followed by a fenced block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{page}:{i + 2}: the fenced block is never closed")
        found.append(Block(page, i + 2, m.group(1).strip(), "\n".join(lines[i + 2:end])))
    return found


def all_blocks(pages=None) -> list[Block]:
    pages = pages or sorted((ROOT / "docs").glob("*.md"))
    return [b for p in pages for b in blocks(Path(p).resolve())]


def _line_pattern(line: str) -> str:
    masks = []
    for finder, replacement in _TIMES:
        masks += [(m.start(), m.end(), replacement) for m in finder.finditer(line)]
    masks.sort()
    out, at = [], 0
    for start, end, replacement in masks:
        if start < at:
            continue
        out += [_literal(line[at:start]), replacement]
        at = end
    out.append(_literal(line[at:]))
    return "".join(out)


def _literal(text: str) -> str:
    parts = text.split("...")
    return ".*?".join(re.sub(r"(\\ )+", " +", re.escape(p)) for p in parts)


def pattern(text: str) -> re.Pattern:
    rows = []
    for line in text.splitlines():
        if line.strip() == "...":
            rows.append(r"(?:[^\n]*\n)*?")
        else:
            rows.append(r"[ \t]*" + _line_pattern(line.strip()) + r"[ \t]*\n")
    return re.compile("(?m)^" + "".join(rows))


def agrees(block_text: str, output: str) -> bool:
    return pattern(block_text).search(output.rstrip("\n") + "\n") is not None


def argv(command: str) -> list[str]:
    """The command as this checkout runs it: ``distlab``/``torchrun``/``python`` from this
    interpreter's environment, ``sudo`` dropped (the caller decides whether it may run)."""
    words = shlex.split(command)
    if words[0] == "sudo":
        words = words[1:]
    if words[0] == "python":
        return [sys.executable] + words[1:]
    if words[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run"] + words[1:]
    if words[0] == "distlab":
        return [sys.executable, "-m", "distlab"] + words[1:]
    raise ValueError(f"no way to run {command!r}: output commands start with python, torchrun or distlab")


def run(command: str, workdir: Path, timeout: float = 300, in_process=None) -> str:
    """Run a page's command in ``workdir`` (which sees examples/ and results/ of this checkout). ``in_process``:
    runs a ``distlab`` part instead of a new interpreter -- ``in_process(ARGS, workdir, env)`` returns (exit code,
    stdout, stderr), as the test suite's ``invoke`` does."""
    for name in ("examples", "results"):
        link = workdir / name
        if not link.exists():
            link.symlink_to(ROOT / name)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    # a new interpreter imports this checkout's distlab (the caller's process has it already)
    fresh_env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))}
    outputs = []
    for part in command.split(" && "):
        words = argv(part)
        if in_process is not None and words[1:3] == ["-m", "distlab"]:
            code, out, err = in_process(words[3:], workdir, env)
            proc = subprocess.CompletedProcess(words, code, out, err)
        else:
            proc = subprocess.run(words, capture_output=True, text=True, timeout=timeout, env=fresh_env, cwd=workdir)
        if proc.returncode != 0:
            raise RuntimeError(f"`{part}` exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        outputs.append(proc.stdout)
    return "".join(outputs)


def _rewrite(block: Block, output: str) -> None:
    lines = block.page.read_text().splitlines()
    old = block.text.splitlines()
    lines[block.line:block.line + len(old)] = output.rstrip("\n").splitlines()
    block.page.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pages", nargs="*", help="pages to check (default: every page in docs/)")
    ap.add_argument("--write", action="store_true",
                    help="replace each disagreeing block that has no '...' with the command's output")
    args = ap.parse_args()
    bad = 0
    outputs: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        # last block first, so a rewrite never moves a block still to come
        for block in sorted(all_blocks(args.pages), key=lambda b: (str(b.page), -b.line)):
            if block.command not in outputs:
                outputs[block.command] = run(block.command, Path(tmp))
            output = outputs[block.command]
            if agrees(block.text, output):
                print(f"ok    {block.where()}  {block.command}")
                continue
            bad += 1
            print(f"DIFFERS {block.where()}  {block.command}\n--- page\n{block.text}\n--- output\n{output}")
            if args.write and "..." not in block.text:
                _rewrite(block, output)
                print(f"rewrote {block.where()}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
