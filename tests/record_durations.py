"""Write tests/module_seconds.json from a JUnit XML report of a whole-suite run: each test
module's seconds (the sum of its tests' setup, call and teardown, as pytest reports them).
tests/conftest.py orders modules by it, longest first.

    .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --junitxml=/tmp/suite.xml
    .venv/bin/python tests/record_durations.py /tmp/suite.xml

Record from a fresh clone on the CI machine's kind (2 cores): the order only matters there.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

OUT = Path(__file__).with_name("module_seconds.json")


def module_seconds(report: Path) -> dict[str, float]:
    seconds: Counter[str] = Counter()
    for case in ET.parse(report).iter("testcase"):
        # classname: tests.e2e.test_x, or tests.e2e.test_x.TestClass for a test in a class.
        parts = [p for p in case.get("classname", "").split(".") if not p[:1].isupper()]
        seconds["/".join(parts) + ".py"] += float(case.get("time") or 0.0)
    return {module: round(s, 1) for module, s in seconds.most_common()}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print("usage: record_durations.py REPORT.xml  (a pytest --junitxml report of the whole suite)", file=sys.stderr)
        return 2
    found = module_seconds(Path(argv[0]))
    OUT.write_text(json.dumps(found, indent=1) + "\n")
    print(f"wrote {OUT}: {len(found)} modules, {sum(found.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
