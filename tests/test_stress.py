"""A few hundred random collectives on 3 ranks, each checked against a reference, with
mistakes injected on one rank that must raise on every rank (tests/stress_workers.py).
The seed is fixed; HVD_STRESS_SEED=N runs another plan."""
import os

from tests.harness import run_workers


def test_random_collectives_and_injected_mistakes_on_three_ranks():
    env = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1",
           "HVD_STRESS_SEED": os.environ.get("HVD_STRESS_SEED", "1234")}
    results = run_workers("tests.stress_workers:run", 3, args=["300"], env=env, timeout=300)
    assert all("stress ok" in r.output for r in results)
