"""How both sides cut work into jobs (`split_jobs`) and keep track of a request's running jobs (`JobsByOwner`),
and the admission contract every policy follows (`AdmissionPolicy`)."""
import pytest

from tiercache.contracts.connector import RequestState
from tiercache.contracts.jobs import JobsByOwner, split_jobs
from tiercache.contracts.plan import JobId
from tiercache.policies import AdmissionPolicy, GuardedTier, admission_for, admission_policies, guards_entry


def test_work_is_dealt_round_robin_into_one_job_per_worker_and_never_an_empty_one():
    assert split_jobs(list(range(7)), 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert split_jobs([0, 1], 4) == [[0], [1]]                # fewer items than workers: one job each
    assert split_jobs([0, 1, 2], 1) == [[0, 1, 2]]            # a tier that moves a batch best as one
    assert split_jobs([], 4) == []


def test_a_request_is_tracked_while_any_of_its_jobs_runs():
    jobs = JobsByOwner()
    jobs.add("a", JobId(1))
    jobs.add("a", JobId(2))
    jobs.add("b", JobId(3))
    assert jobs.of("a") == {1, 2} and "a" in jobs and len(jobs) == 2
    jobs.finish("a", JobId(1))
    assert "a" in jobs                                         # one job left
    jobs.finish("a", JobId(2))
    assert "a" not in jobs and jobs.of("a") == frozenset()   # its last job ended: it leaves
    jobs.finish("a", JobId(2))                                 # a report delivered twice changes nothing
    jobs.forget("b")                                           # waited for by its caller
    assert len(jobs) == 0 and list(jobs) == []


def test_a_policy_writes_only_admit_and_ignores_what_it_has_no_use_for():
    class Odd(AdmissionPolicy):
        def admit(self, key, hits):
            return hits % 2 == 1

    policy = Odd()
    policy.size_for(GuardedTier(8))
    policy.record([b"k"])
    policy.retain([b"k"], RequestState.FINISHED)
    assert policy.admit(b"k", 1) and not policy.admit(b"k", 2)
    assert not policy.admits_into_room and not policy.counts_requests
    with pytest.raises(TypeError):
        AdmissionPolicy()                                      # admit has no default


def test_only_policies_that_count_requests_guard_the_tier_chunks_enter():
    for name in admission_policies.names():
        policy = admission_for(name, 1, GuardedTier(16))
        assert isinstance(policy, AdmissionPolicy)
        assert guards_entry(name) == (name == "always" or policy.counts_requests)
    assert not guards_entry("min-hits") and guards_entry("second-sighting")
