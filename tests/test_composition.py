"""docs/composition.md's table of every feature on every layout (distlab.tools.composition): the page is what
the code says -- each "no" the refusal ``distlab train`` gives, each "yes" a run the code accepts -- and
every "yes" trains as one process does."""

from __future__ import annotations

from pathlib import Path

import pytest

from distlab.tools import composition
from tests.conftest import patience

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def found():
    return composition.cells()


def test_the_page_holds_the_table_the_code_gives(found):
    """Regenerated from the code, the block between docs/composition.md's markers is unchanged (else: python
    scripts/composition.py --write); every feature has a cell on every layout; a refusal reads as its reason,
    and none says a piece is missing but NF4's two."""
    text = (ROOT / "docs" / "composition.md").read_text()
    assert composition.written(text, found) == text, "docs/composition.md is stale: python scripts/composition.py --write"
    assert len(found) == len(composition.FEATURES) * len(composition.LAYOUTS)
    unbuilt = {c.reason for c in found if c.reason and "not" in c.reason and "here" in c.reason}
    assert all("NF4" in r for r in unbuilt), unbuilt


def test_a_refused_cell_is_refused_from_the_command_line_in_one_line(found, refused_here):
    """A "no" is what a user typing the layout and the feature gets: one line, before launch."""
    proc = refused_here("train", "--model", "llama", "--n-layer", "2", "--n-embd", "16", "--n-head", "4",
                        "--dataset", "synthetic-text:4000", "--block-size", "8", "--global-batch-size", "4",
                        "--max-steps", "1", "--no-progress", "--nproc-per-node", "2", "--pp", "2", "--grad-accum", "2")
    reason = next(c.reason for c in found if c.feature == "grad accumulation" and c.layout == "PP 1F1B")
    assert reason.startswith("a pipeline accumulates gradients over its"), reason
    assert proc.stderr.count("\n") == 1 and "a pipeline accumulates gradients over its --microbatches" in proc.stderr, \
        proc.stderr


@pytest.mark.parametrize("world", [2, 4])
def test_every_verified_cell_trains_as_one_process(found, world):
    """Every "yes" on ``world`` ranks, one launch, two steps each: within verify's float32 bound of one process.
    The compiled cells through aot_eager -- the graphs and graph breaks inductor gets (tests/test_compile.py runs
    inductor itself), without a C++ compiler's minutes per rank on 2 cores."""
    from distlab.tools.verify import parse_strategy, verify
    cells = [c for c in found if c.reason is None and c.world == world]
    assert cells
    cases = [parse_strategy(c.case.replace("+compile", "+compile+compile_backend=aot_eager")) for c in cells]
    records = verify(cases, world, steps=2, timeout=patience(1800))
    failed = [(c.case, r["max_abs_param_diff"], r["tolerance"]) for c, r in zip(cells, records) if not r["passed"]]
    assert not failed, failed
