"""Grades cases in a fresh process, first one by one in process (``dapo.rewards.grade``), then in a RewardPool with
reward.*'s defaults, and prints both lists of verdicts as JSON: tests/test_grading_load.py runs it on an idle
machine and beside busy processes. A fresh process, because the costs that a busy machine stretched past the limit
are a process's first ones (imports, the first parse of each kind of expression).

    python tests/grading_verdicts.py CASES.json   # [[response, truth, grader], ...]
"""

import json
import sys

from dapo.rewards import RewardPool, grade


def main(path: str) -> None:
    cases = json.loads(open(path).read())
    in_process = [[x.score, x.acc, x.pred, x.ungraded] for x in (grade(r, t, g) for r, t, g in cases)]
    with RewardPool(num_workers=2, timeout_s=5.0) as pool:
        result = pool.score(*map(list, zip(*cases)))
    in_pool = [[g.score, g.acc, g.pred, g.ungraded] for g in result.grades]
    print(json.dumps({"in_process": in_process, "pool": in_pool, "retried": result.num_retried}))


if __name__ == "__main__":
    main(sys.argv[1])
