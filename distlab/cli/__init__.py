"""``distlab``: thin command line over the packages (parse, build config, call in, print).

One module per command family: :mod:`.train` (train, export, verify, report, doctor), :mod:`.data`
(prepare-text), :mod:`.plan`, :mod:`.bench`, :mod:`.cluster` (cluster, demo); :mod:`.options` holds
what they share.

Every command that runs on several processes takes the same launch flags: ``--nproc-per-node N``
hands off to torchrun (with its flag names); ``--rank R --world-size W --master-addr A`` starts
one rank of a manual multi-node job; under torchrun, mpirun or srun the command just runs.
"""

from __future__ import annotations

import os
import sys

# c10d logs connection failures with C++ stack frames; distlab reports them as one line.
# Set TORCH_CPP_LOG_LEVEL=INFO to see them again. Must be set before torch is imported.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

import click  # noqa: E402

from distlab.cli import bench, cluster, data, plan, train  # noqa: E402
from distlab.errors import DistlabError  # noqa: E402


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="distlab")
def cli():
    """distlab: distributed training from first principles, measured against PyTorch's own."""


for command in (train.train, data.prepare_text, train.export, train.generate, train.verify, train.report, plan.plan,
                cluster.cluster, cluster.demo, bench.bench, train.doctor):
    cli.add_command(command)


def _report_error(exc: DistlabError) -> None:
    from distlab.runtime import detect_launch
    try:
        rank = detect_launch().rank
    except DistlabError:
        rank = 0
    from distlab.runtime.launch import keep_error_line
    from distlab.tools.flags import flagify
    # An error of one rank names it; one every rank meets is the same line wherever it is said.
    prefix = f"[rank {rank}] " if rank and not exc.every_rank and not str(exc).startswith(f"rank {rank}:") else ""
    line = f"distlab: error: {prefix}{flagify(str(exc))}"
    keep_error_line(rank, line, said=False)  # the launcher says it if this rank is stopped before it could
    if rank != 0 and exc.every_rank:
        return  # every rank finds the same error; rank 0 says it once
    print(line, file=sys.stderr, flush=True)
    keep_error_line(rank, line, said=True)


def main(argv: list[str] | None = None) -> None:
    try:
        rv = cli.main(args=argv, prog_name="distlab", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:  # a flag click could not take: one line, as every other bad input
        print(f"distlab: error: {exc.format_message()}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
    except (click.Abort, KeyboardInterrupt):
        print("distlab: stopped at once (Ctrl-C)", file=sys.stderr, flush=True)
        sys.exit(130)
    except DistlabError as exc:
        _report_error(exc)
        sys.exit(exc.exit_code)
    sys.exit(rv if isinstance(rv, int) else 0)


def run() -> None:
    """The ``distlab`` command itself (console script, ``python -m distlab``): :func:`main`, then the exit
    handlers, then a hard exit with its code -- no interpreter teardown, where torch's daemon threads (a
    launch's rendezvous keep-alive) occasionally print half a traceback into a finished command's
    output. (In-process callers use :func:`main`, which raises ``SystemExit`` as usual.)"""
    import atexit
    try:
        main()
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    atexit._run_exitfuncs()  # what exit would run: locks released, temporary directories removed, logs flushed
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
