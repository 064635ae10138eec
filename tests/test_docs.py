"""The README and docs/ say what the code does: the README's first screen gets a new user to a
multi-process run and to every capability's page; every link resolves; every output block of a
distlab command agrees with what that command prints now (example scripts' blocks are checked in
tests/test_examples.py, where the scripts run); every command they show names commands and flags that exist."""

import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import doc_outputs  # noqa: E402 - scripts/ is not a package
from tests.conftest import invoke  # noqa: E402

README = (ROOT / "README.md").read_text()
PAGES = sorted((ROOT / "docs").glob("[0-9][0-9]-*.md"))


def test_the_first_80_lines_get_a_new_user_running_and_to_every_page():
    first = "\n".join(README.splitlines()[:80])
    assert "make run" in first and "make test" in first                           # set-up from a clone
    assert re.search(r"distlab train --nproc-per-node \d", first)                 # a multi-process run
    for launcher in ("torchrun", "--master-ip", "srun", "mpirun"):                # every way to launch
        assert launcher in first, launcher
    for page in PAGES + [ROOT / "docs" / "RESULTS.md", ROOT / "docs" / "ARCHITECTURE.md"]:
        assert f"(docs/{page.name})" in first, f"the README's first screen does not link docs/{page.name}"
    sections = [line for line in README.splitlines() if line.startswith("## ")]
    assert sections.index("## Using it") < sections.index("## Results") < sections.index("## Development")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: p.name)
def test_every_relative_link_resolves(doc):
    text = doc.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        where = (doc.parent / path).resolve() if path else doc
        assert where.exists(), f"{doc.name}: link to {target} points nowhere"
        if anchor and where.suffix == ".md":
            anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", where.read_text(), flags=re.M)}
            assert anchor in anchors, f"{doc.name}: no heading for #{anchor} in {where.name}"


COMMAND_BLOCKS = [b for b in doc_outputs.all_blocks() if b.command.startswith("distlab ")]


@pytest.mark.parametrize("block", COMMAND_BLOCKS, ids=lambda b: b.where())
def test_command_output_blocks_agree_with_the_command(block, tmp_path):
    # in this process, as tests/conftest.py's run_cli runs a command (what a launch's workers print caught too)
    output = doc_outputs.run(block.command, tmp_path, timeout=240,
                             in_process=lambda args, cwd, env: invoke(args, cwd, env=env, fds=True))
    assert doc_outputs.agrees(block.text, output), (
        f"{block.where()} shows output that `{block.command}` no longer prints:\n--- page\n{block.text}\n"
        f"--- output\n{output}")


def test_a_stale_block_is_caught():
    """The matcher is strict where it must be: a byte count that changed is a disagreement, a time
    that changed is not."""
    printed = "  ring            result 10  bytes sent by rank 0   32, by rank 1   36\n  step 4.48 ms\n"
    assert doc_outputs.agrees("  ring   result 10  bytes sent by rank 0   32, by rank 1   36\n  step 9.1 ms", printed)
    assert not doc_outputs.agrees("  ring   result 10  bytes sent by rank 0   36, by rank 1   36", printed)
    assert doc_outputs.agrees("...\n  step 1 ms", printed) and not doc_outputs.agrees("  step 4.48 s", printed)
    # threads and cores are the machine's: a page written on 2 cores agrees with a 16-core run
    header = "strategy tp=2 on 4 processes x 4 threads, gloo on cpu\nwarning  8 threads for 16 cores\n"
    assert doc_outputs.agrees("strategy ... on 4 processes x 1 thread, gloo on cpu", header)
    assert doc_outputs.agrees("warning  4 threads for 2 cores", header)
    assert not doc_outputs.agrees("strategy ... on 2 processes x 4 threads, gloo on cpu", header)


def test_there_is_one_way_to_step_an_engine():
    # opt.step() then engine.after_step() skipped fp16's overflow handling: Engine.step(opt) does all of it.
    from distlab.parallel import Engine
    assert not hasattr(Engine, "after_step")
    texts = [p for p in [*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("examples/*.py")]
             if "engine.after_step" in p.read_text() or re.search(r"engine = parallelize[\s\S]*\bopt\.step\(\)", p.read_text())]
    assert texts == []


LAUNCHERS = {"torchrun", "srun", "mpirun", "python", "python3", "sudo", "time", "env", "nohup"}


def _shown_commands():
    """``(where, command, arguments)`` of every distlab command a fenced shell block of the README or docs/ shows
    (after a launcher or environment settings too; output blocks left out) and every example in a command's help."""
    from distlab.cli import cli
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for m in re.finditer(r"```(bash|sh|shell|console)?\n(.*?)```", text, re.S):
            if "output of" in "".join(text[:m.start()].rstrip().splitlines()[-1:]):
                continue  # a command's output (test_command_output_blocks_agree_with_the_command)
            for line in re.sub(r"\\\n\s*", " ", m.group(2)).splitlines():
                for part in re.split(r"&&|\|\||;|\|", re.sub(r"\s#.*$", "", line).strip()):
                    try:
                        words = shlex.split(part)
                    except ValueError:  # a line of a multi-line string (a heredoc, a Python snippet)
                        continue
                    while words and (re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]) or words[0] in LAUNCHERS):
                        words = words[1:]
                    if words and (words[0] == "distlab" or words[0].endswith("/distlab")):
                        yield page.name, part.strip(), words[1:]
                    elif "distlab" in words and words[words.index("distlab") - 1] == "-m":
                        yield page.name, part.strip(), words[words.index("distlab") + 1:]

    def helps(group, path):
        for name, cmd in group.commands.items():
            for line in (cmd.help or "").splitlines():
                if line.strip().startswith("distlab "):
                    yield f"distlab {' '.join(path + (name,))} --help", line.strip(), shlex.split(line)[1:]
            if hasattr(cmd, "commands"):
                yield from helps(cmd, path + (name,))
    yield from helps(cli, ())


def test_every_command_the_docs_show_takes_its_flags():
    """Parsed as the command line parses them (click, nothing run): a command or flag that does not exist --
    `plan --ac-policy` was shown before plan took it -- fails here, not in a user's shell. Values are not
    judged (the pages write placeholders: MODEL_DIR, N)."""
    import warnings

    import click

    from distlab.cli import cli

    def rest(ctx):  # a group's subcommand and what follows it, as click leaves them
        return [*getattr(ctx, "_protected_args", []), *ctx.args]

    wrong, shown = [], 0
    for where, command, args in _shown_commands():
        if {"--help", "-h"} & set(args):
            continue
        shown += 1
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ctx = cli.make_context("distlab", list(args))
                cmd, left = cli, rest(ctx)
                while isinstance(cmd, click.Group) and left:
                    name, sub, left = cmd.resolve_command(ctx, left)
                    ctx = sub.make_context(name, left, parent=ctx)
                    cmd, left = sub, rest(ctx) if isinstance(sub, click.Group) else []
        except click.NoSuchOption as exc:
            wrong.append(f"{where}: {command}: {exc.format_message()}")
        except click.UsageError as exc:
            if "No such command" in exc.format_message():
                wrong.append(f"{where}: {command}: {exc.format_message()}")
        except click.exceptions.Exit:
            pass
    assert shown > 60 and not wrong, "\n".join(wrong)
