"""A long-lived process starts without the cyclic collector and freezes what it built
(src/ratchet/start_up_gc.py). Each check runs in a process of its own: freezing the test
process's heap would change what every later test's collections see."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "leaked" not in out.stderr, out.stderr  # unfrozen at exit: finalisation sees every object
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_start_up_runs_without_the_collector_then_freezes_what_it_built():
    seen = _run(
        """
        import gc, json
        from ratchet.start_up_gc import start_up

        collections = []
        gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
        frozen_before = gc.get_freeze_count()
        with start_up():
            inside = gc.isenabled()
            kept = [[i] for i in range(50_000)]  # allocations that would trigger collections
            during = len(collections)
        print(json.dumps({"inside": inside, "after": gc.isenabled(), "during": during,
                          "frozen": gc.get_freeze_count() - frozen_before}))
        """
    )
    assert seen["inside"] is False and seen["during"] == 0
    assert seen["after"] is True
    assert seen["frozen"] >= 50_000  # the lists made inside are out of the collector's sight


def test_a_collector_turned_off_by_the_caller_stays_off():
    seen = _run(
        """
        import gc, json
        from ratchet.start_up_gc import start_up

        gc.disable()
        with start_up():
            pass
        print(json.dumps({"after": gc.isenabled()}))
        """
    )
    assert seen == {"after": False}


def test_every_actor_starts_without_the_collector_and_keeps_its_signature():
    """Ray reads a method's signature to check a call's arguments: the decorator keeps it."""
    from ratchet.workers.critic import CriticWorker
    from ratchet.workers.reward import RewardWorker
    from ratchet.workers.rollout import RolloutWorker
    from ratchet.workers.trainer import TrainerWorker

    started = [TrainerWorker.__init__, TrainerWorker.setup, RolloutWorker.__init__, RewardWorker.__init__, CriticWorker.__init__]
    for method in started:
        assert hasattr(method, "__wrapped__"), f"{method.__qualname__} is not decorated with during_start_up"
        assert inspect.signature(method) == inspect.signature(method.__wrapped__), method.__qualname__
    # (`ray.remote(cls)` in this process, as other tests do, adds Ray's own `_ray_trace_ctx`.)
    params = [p for p in inspect.signature(TrainerWorker.setup).parameters if not p.startswith("_ray")]
    assert params == ["self", "master_port", "master_addr"]
