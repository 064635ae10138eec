"""The composition table of docs/composition.md: every feature on every layout, each cell the verify case that
proves it equal to one process or the reason ``distlab train`` refuses it (distlab.tools.composition).

    python scripts/composition.py            # print the table
    python scripts/composition.py --write    # regenerate docs/composition.md's block
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from distlab.tools import composition
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace docs/composition.md's generated block")
    args = parser.parse_args()
    found = composition.cells()
    if not args.write:
        print(composition.block(found))
        return
    page = ROOT / "docs" / "composition.md"
    page.write_text(composition.written(page.read_text(), found))
    print(f"wrote {sum(c.reason is None for c in found)} verified and "
          f"{sum(c.reason is not None for c in found)} refused cells into {page}")


if __name__ == "__main__":
    main()
