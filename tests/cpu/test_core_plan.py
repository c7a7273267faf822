"""The engine's core plan: the engine thread keeps a core, the pool never wraps onto it, and
what the flags asked for beyond the usable cores is cut and said."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from freetoken.cpu.cores import CorePlan, core_plan, usable_cores


@pytest.mark.parametrize(
    ("usable", "threads", "workers", "torch_threads", "asked"),
    [
        ([0, 1, 2, 3], None, (1, 2, 3), 1, None),
        ([0, 1, 2, 3], 2, (1, 2), 2, None),
        ([0, 1, 2, 3], 4, (1, 2, 3), 1, 4),  # all usable cores asked: one left to the engine
        ([4, 5], 16, (5,), 1, 16),  # an affinity mask smaller than the machine
        ([7], None, (7,), 1, None),  # one core: the worker shares it
        ([7], 3, (7,), 1, 3),
    ],
)
def test_pool_workers_never_take_the_engine_threads_core(usable, threads, workers,
                                                         torch_threads, asked):
    plan = core_plan(usable, pool=True, threads=threads)
    assert plan.workers == workers and plan.torch_threads == torch_threads
    assert plan.asked == asked
    if len(usable) > 1:
        assert plan.engine not in plan.workers
        assert len(set(plan.workers)) == len(plan.workers)
        assert len(plan.workers) + plan.torch_threads == len(usable)


def test_without_a_pool_torch_takes_every_usable_core():
    plan = core_plan([2, 3, 5], pool=False, threads=8)
    assert plan.workers == () and plan.torch_threads == 3 and plan.shrink_note() is None
    assert plan.line().endswith("no CPU pool")


def test_the_startup_line_and_the_shrink_note_name_the_cores():
    plan = core_plan(list(range(16)), pool=True, threads=16)
    assert plan.line() == ("core plan: 16 usable (cores 0..15); engine thread on core 0, torch 1 "
                           "intra-op thread on core 0; CPU pool 15 workers pinned to cores 1..15")
    note = plan.shrink_note()
    assert note is not None and "--moe-cpu-threads 16" in note and "15 workers" in note
    assert "shared with the engine thread" in core_plan([3], pool=True).line()
    assert core_plan([0, 1], pool=True).shrink_note() is None


def test_rejects_zero_workers_and_no_cores():
    with pytest.raises(ValueError, match="at least 1"):
        core_plan([0, 1], pool=True, threads=0)
    with pytest.raises(ValueError, match="no usable cores"):
        core_plan([], pool=False)
    assert isinstance(core_plan([0], pool=False), CorePlan)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity masks")
def test_an_affinity_mask_of_one_core_is_what_the_engine_plans_for():
    """A child process pinned to one core (as ``taskset -c``) sees one usable core, and a
    pool asked for every core of the machine gets one worker there, said in one line."""
    core = usable_cores()[0]
    code = (f"import os, sys; os.sched_setaffinity(0, {{{core}}}); "
            "from freetoken.cpu.cores import core_plan, usable_cores; "
            "p = core_plan(usable_cores(), True, os.cpu_count()); print(p.workers); "
            "print(p.line())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == f"({core},)"
    assert "1 usable" in out[1] and "shared with the engine thread" in out[1]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(usable_cores()) < 2,
                    reason="needs Linux affinity masks and two usable cores")
def test_the_processs_threads_stay_off_the_pools_cores():
    """In a process that runs one engine, every thread but the pool's workers runs on the
    cores the plan leaves them, as the kernel reports each thread's mask: threads started
    before the pin and after it (torch's, the driver's would be); each worker on its own core;
    and a later plan sees the cores it saw before."""
    from freetoken.cpu.library import available

    if available() is not None:
        pytest.skip(str(available()))
    code = """
import json, os, threading, time
from freetoken.cpu.cores import core_plan, pin_beside_pool, usable_cores
from freetoken.cpu.executor import CpuMoeExecutor
before = usable_cores()
plan = core_plan(before, True)
done = threading.Event()
threading.Thread(target=done.wait).start()
spare = pin_beside_pool(plan)
threading.Thread(target=done.wait).start()
pool = CpuMoeExecutor(threads=len(plan.workers))
for _ in range(200):  # the workers pin themselves once they run
    masks = {}
    for tid in os.listdir("/proc/self/task"):
        for line in open(f"/proc/self/task/{tid}/status"):
            if line.startswith("Cpus_allowed_list"):
                masks[tid] = line.split(":")[1].strip()
    if all(str(c) in masks.values() for c in plan.workers):
        break
    time.sleep(0.01)
done.set()
print(json.dumps({"spare": spare, "workers": list(plan.workers), "masks": masks,
                  "same": usable_cores() == before}))
"""
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True, timeout=120).stdout.splitlines()[-1])

    def cores(text: str) -> set[int]:
        got: set[int] = set()
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            got |= set(range(int(lo), int(hi or lo) + 1))
        return got

    masks = [cores(m) for m in out["masks"].values()]
    workers = [m for m in masks if len(m) == 1 and m <= set(out["workers"])]
    assert sorted(next(iter(m)) for m in workers) == sorted(out["workers"])
    assert all(m == set(out["spare"]) for m in masks if m not in workers)
    assert len(masks) - len(workers) >= 3  # this thread, the two started around the pin
    assert out["same"]


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    path = tmp_path_factory.mktemp("cores") / "tiny.gguf"
    subprocess.run([sys.executable, "-m", "freetoken.cli", "synth", "--preset", "tiny",
                    "--expert-format", "q8_0", "--out", str(path)], check=True,
                   capture_output=True, timeout=300)
    return path


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_one_core_with_two_workers_asked_decodes_the_same_tokens(tiny_q8):
    """`taskset -c` to one core, `--moe-cpu-threads 2`: the plan shrinks to one worker and
    says so, and ft generate gives the tokens it gives on every core (the kernels' bits do not
    depend on the worker count)."""
    from freetoken.cpu.library import available

    if available() is not None:
        pytest.skip(str(available()))
    cmd = [sys.executable, "-m", "freetoken.cli", "generate", "--device", "cpu", "--model",
           str(tiny_q8), "--moe-strategy", "cpu", "--prompt", "one two three",
           "--max-tokens", "12", "--temperature", "0"]
    free = subprocess.run(cmd + ["--moe-cpu-threads", "1"], capture_output=True, text=True,
                          timeout=300)
    one = subprocess.run(["taskset", "-c", str(usable_cores()[0]), *cmd,
                          "--moe-cpu-threads", "2"], capture_output=True, text=True, timeout=300)
    assert free.returncode == 0 and one.returncode == 0, one.stderr[-2000:]
    assert one.stdout == free.stdout and len(one.stdout) > len("one two three")
    assert "--moe-cpu-threads 2 on one usable core" in one.stderr
    assert "1 usable" in one.stderr and "shared with the engine thread" in one.stderr
