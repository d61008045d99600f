"""``cluster/workload.py`` without processes: the two sides are stand-ins with ``submit``."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from sglang_kvxfer.cluster.workload import make_requests, run_workload


class _Side:
    """Answers every job at once with one rank's result."""

    def __init__(self, ok: bool = True):
        self.ok = ok

    def submit(self, job: dict) -> Future:
        fut: Future = Future()
        fut.set_result([{"ok": self.ok, "rank": 0, "reason": "" if self.ok else "broken", "verified": self.ok}])
        return fut


def test_every_finished_request_reaches_the_progress_object():
    seen = []

    class Counter:
        def update(self, res):
            seen.append(res.room)

    jobs = make_requests(3, [16], 0, 16, seed=1)
    results, _ = run_workload(_Side(), _Side(), jobs, 2, 10.0, progress=Counter())
    assert sorted(seen) == sorted(j["room"] for j in jobs) == sorted(r.room for r in results)


def test_a_failed_side_is_named_in_the_reason():
    (res,), _ = run_workload(_Side(ok=False), _Side(), make_requests(1, [16], 0, 16), 1, 10.0)
    assert not res.ok and "prefill rank 0: broken" in res.reason


@pytest.mark.parametrize("progress", [True, "yes"])
def test_progress_must_be_an_object_with_update(progress):
    with pytest.raises(TypeError, match="must be None, False or an object with update"):
        run_workload(_Side(), _Side(), make_requests(1, [16], 0, 16), 1, 10.0, progress=progress)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"n": 0, "tokens": [16], "chunk_tokens": 0, "page_size": 16}, "--requests=0 must be >= 1"),
        ({"n": 1, "tokens": [16], "chunk_tokens": -1, "page_size": 16}, "--chunk-tokens=-1 must be >= 0"),
    ],
)
def test_request_stream_rejections_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_requests(**kwargs)


def test_concurrency_below_one_is_refused():
    with pytest.raises(ValueError, match="--concurrency=0 must be >= 1"):
        run_workload(_Side(), _Side(), [], 0, 10.0)
