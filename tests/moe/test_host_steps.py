"""A late step between graph pieces (``moe/host_steps.py``): it prepares the next plan while the
CPU's job runs on, collects the job even where that prepare fails, and lands the pool's
float32 result as it is, for the next piece to cast."""

from __future__ import annotations

import pytest
import torch

from freetoken.moe.host_steps import LateStep


class _NextPlan:
    """The next host step, as the late step sees it: what it was asked and when."""

    def __init__(self, seen: list[str], fails: bool = False) -> None:
        self.seen, self.fails = seen, fails

    def prepare_ahead(self, n: int) -> None:
        self.seen.append(f"prepare {n}")
        if self.fails:
            raise RuntimeError("no room for the next plan")


def test_the_next_plan_is_prepared_before_the_job_is_waited_for():
    seen: list[str] = []
    result = torch.randn(3, 8)  # the pool's float32 rows

    def finish() -> torch.Tensor:
        seen.append("finish")
        return result

    like = torch.zeros(4, 8, dtype=torch.bfloat16)
    step = LateStep(finish, like)
    step.then = _NextPlan(seen)
    step.run(3)
    assert seen == ["prepare 3", "finish"]
    assert step.out.dtype is torch.float32 and torch.equal(step.out[:3], result)
    # what the next piece reads: torch's own rounding of the float32 result, rows past n zero
    assert torch.equal(step.out.to(like.dtype)[:3], result.to(torch.bfloat16))
    assert not step.out[3:].any()


def test_a_failed_prepare_still_collects_the_job():
    seen: list[str] = []
    step = LateStep(lambda: seen.append("finish") or None, torch.zeros(2, 4))
    step.then = _NextPlan(seen, fails=True)
    with pytest.raises(RuntimeError, match="no room for the next plan"):
        step.run(2)
    assert seen == ["prepare 2", "finish"]


def test_a_step_without_a_result_clears_the_last_one():
    results = [torch.ones(1, 4), None]
    step = LateStep(lambda: results.pop(0), torch.zeros(1, 4, dtype=torch.bfloat16))
    step.run(1)
    assert step.out.sum() == 4
    step.run(1)  # no CPU share this time: the landing holds zeros again
    assert not step.out.any()
