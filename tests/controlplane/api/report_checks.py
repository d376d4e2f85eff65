"""The check that a job's resilience report equals what the operator API says about its cycles and faults
(used by the API test on a built job and by the end-to-end test on real drill runs)."""

from __future__ import annotations

import math


def nearest(values, p):
    s = sorted(v for v in values if v is not None)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)] if s else None


def _all(get, url, key):
    out, page = [], get(url)
    out += page[key]
    while page.get("next"):
        page = get(page["next"])
        out += page[key]
    return out


def assert_report_matches_api(get, job_id: int) -> dict:
    """``get(url)`` answers the API's JSON. Returns the report."""
    report = get(f"/api/v1/jobs/{job_id}/report")
    cycles = {c["key"]: c for c in _all(get, f"/api/v1/jobs/{job_id}/cycles", "cycles")}
    faults = _all(get, f"/api/v1/jobs/{job_id}/faults", "faults")
    # A cycle's class is its first recorded fault's; a cycle that another finished is counted there.
    first: dict[str, dict] = {}
    for f in sorted(faults, key=lambda f: f["id"]):
        if f["cycle"] is not None:
            first.setdefault(f["cycle"], f)
    finished_by_other = {c["escalated_to"] for c in cycles.values() if c["escalated_to"]}
    by_class = {r["fault_class"]: r for r in report["classes"]}
    assert {f["fault_class"] for f in faults} <= set(by_class)
    for name, row in by_class.items():
        mine = [f for f in faults if f["fault_class"] == name]
        assert row["faults"] == len(mine) and sorted(row["fault_ids"]) == sorted(f["id"] for f in mine), name
        keys = sorted(k for k, c in cycles.items() if k not in finished_by_other
                      and (first[k]["fault_class"] if k in first else "operator_restart") == name)
        assert sorted(row["cycles"]) == keys, name
        assert row["recovery"]["p50_s"] == nearest([cycles[k]["recovery_s"] for k in keys], 50), name
        assert row["recovery"]["p95_s"] == nearest([cycles[k]["recovery_s"] for k in keys], 95), name
        assert row["detection"]["p50_s"] == nearest([cycles[k]["detection_s"] for k in keys], 50), name
        assert row["recovered"] + row["open"] + row["not_recovered"] >= len(keys), name
    assert report["recovery"]["recovery"]["p95_s"] == nearest([c["recovery_s"] for c in cycles.values()], 95)
    for phase in report["recovery"]["phases"]:
        values = [c["durations"].get(phase["name"]) for c in cycles.values()]
        assert phase["p50_s"] == nearest(values, 50), phase["name"]
    assert {r["cycle"]: r["lost_steps"] for r in report["lost"]["rows"]} == {
        k: c["lost_steps"] for k, c in cycles.items()}
    return report
