"""NVRx 0.7's deterministic log attribution (its restart agent's L0 step) on one job log, as JSON: a
second opinion beside ours, run where NVRx 0.7 is installed (``make nvrx-third``), never by the product.

    PYTHONPATH=.nvrx/0.7.0/site python tests/bench/nvrx_attribution.py <job log>

Prints {"primary": {failure_class, rank, quote, line} | null, "cascades": [{failure_class, count, ranks}]}.
"""

import json
import sys


def main(path: str) -> int:
    from nvidia_resiliency_ext.attribution.restart_agent.l0.assembly import build_l0_bundle

    b = build_l0_bundle(path)
    p = b.deterministic_primary_candidate
    out = {"primary": None if p is None else {"failure_class": p.failure_class, "rank": p.rank,
                                              "quote": (p.quote or "")[:200], "line": p.line},
           "cascades": [{"failure_class": c.failure_class, "count": c.count, "ranks": list(c.rank_spread)}
                        for c in b.cascades]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
