"""After `mutmut run` (make mutate): the mutation score of each mutated module, and its survivors.

Score = killed / (killed + survived); a timeout counts as killed (the test run did not pass), and
mutants not checked yet or reached by no selected test are counted apart."""

from __future__ import annotations

import collections
import json
from pathlib import Path

from mutmut.stats import status_by_exit_code


def main() -> None:
    for meta in sorted(Path("mutants").rglob("*.py.meta")):
        statuses = {
            name: status_by_exit_code[code] for name, code in json.loads(meta.read_text())["exit_code_by_key"].items()
        }
        counts = collections.Counter("killed" if s == "timeout" else s for s in statuses.values())
        judged = counts["killed"] + counts["survived"]
        if not judged:
            continue
        module = str(meta.relative_to("mutants")).removesuffix(".meta")
        others = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()) if s not in ("killed", "survived"))
        print(
            f"{module}: {counts['killed']}/{judged} killed = {counts['killed'] / judged:.1%}"
            + (f" ({others})" if others else "")
        )
        for name, status in sorted(statuses.items()):
            if status == "survived":
                print(f"    survived: {name}")


if __name__ == "__main__":
    main()
