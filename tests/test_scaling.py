"""bench/scaling.py, small: partitions as threads, each with its own S3 client, running the
product's shard plan, claims, retakes and writes against the session's loopback moto S3, with
stub engines. Behaviour only (every item written, no shard lost, the S3 requests counted and
bounded, the model beside the measurement); the timing figures are docs/benchmarks.md's."""

from __future__ import annotations

import pytest

from vlm_caption.bench.scaling import Scenario, simulate

MODEL_TERMS = {"F_first_shard", "P_plan_poll", "H_start_lost_claims", "E_engine_start", "G_generate", "T_last_write",
               "W_wait_for_others"}


@pytest.fixture
def loopback(s3_endpoint):
    """The simulation's clients read the endpoint from the settings the session's moto set."""
    return s3_endpoint


def every_shard_generated(run: dict) -> bool:
    return sorted({index for p in run["by_partition"] for index in p["generated"]}) == list(range(run["shards"]))


def test_partitions_share_every_shard_and_the_report_sets_the_model_beside_the_measurement(loopback):
    report = simulate(Scenario(items=64, shard_size=8, rate=400.0, start_s=0.2, end_poll_s=0.1), (1, 4))
    assert report["calibrated_on"] == 1 and [run["partitions"] for run in report["runs"]] == [1, 4]
    for run in report["runs"]:
        assert run["items_missing"] == 0 and every_shard_generated(run), run
        # No partition is gone here: nothing retaken, nothing captioned twice (a holder that marks
        # its last shards done and says it finished while another reads the claims is not retaken from)
        assert run["shards_retaken"] == 0 and run["shards_generated_twice"] == 0, run
        assert run["items_written_twice"] == 0, run
        assert sum(p["claimed"] for p in run["by_partition"]) == run["shards"] + run["shards_retaken"]
        assert set(run["model_terms"]) == MODEL_TERMS and run["model_s"] > 0 and run["wall_s"] > 0
        assert run["ratio"] == pytest.approx(run["wall_s"] / run["model_s"], abs=0.002)
        assert run["model_at_its_latency_s"] > 0 and run["measured"]["latency_s"] > 0  # the store's, as this run saw it
        # While captioning, a shard's claim, part and done mark, its lost claims' PUT, read-back
        # and listing of the claims, the plan's reads; a partition's own few (the done-index, the
        # lister's claim, heartbeats, the plan's listing while it waits for a chunk). Then the
        # parent deletes the run's claims, done marks, heartbeats and plan.
        assert 0 < run["s3_requests_per_item"], run
        assert run["s3_by_phase"]["run"] <= 20 * run["shards"] + 40 * run["partitions"], run
        assert run["s3_by_kind"]["claim"] >= run["shards"] and run["s3_by_area"]["outputs"] >= run["shards"]
        assert run["s3_by_phase"]["cleanup"] <= 2 * run["shards"] + 4 * run["partitions"] + 10, run
    one, four = report["runs"]
    assert one["lost_claims"] == 0 and one["shards_retaken"] == 0 and one["items_written_twice"] == 0
    assert [p["lists"] for p in four["by_partition"]].count(True) == 1  # the source listed once


def test_the_shards_of_a_partition_whose_engine_failed_are_retaken_and_none_is_lost(loopback):
    """Partition 1's engine fails as it comes up: the shards it claimed while it started are
    dropped, claimed and never done; it says it finished, and the others retake them at once."""
    scenario = Scenario(items=96, shard_size=8, rate=400.0, start_s=3.0, end_poll_s=0.1, fails_after={1: 0})
    run = simulate(scenario, (3,))["runs"][0]
    failed = run["by_partition"][1]
    assert failed["failed"] and failed["generated"] == [] and failed["claimed"] >= 1, run
    assert run["shards_retaken"] >= failed["claimed"]
    assert run["items_missing"] == 0 and every_shard_generated(run), run
    assert run["shards_generated_twice"] == 0 and run["items_written_twice"] == 0, run
