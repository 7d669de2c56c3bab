"""Swap or recompute by cost (`tiercache.engine.preemption`): the decisions the module docstring promises."""
import pytest

from tiercache.engine import EngineConfig
from tiercache.engine.preemption import SWAP_JOB_S, ByCost, Rates, Victim, preemption_policies
from tiercache.errors import ConfigError


def rates(prefill_us: float = 50.0, copy_us: float = 1.0) -> Rates:
    r = Rates(kv_bytes_per_token=2048)
    r.observe_step(1000, prefill_us * 1e-3)
    r.observe_copies({"device→cpu": (copy_us * 1e-6 * 16 * 64, 64), "cpu→device": (copy_us * 1e-6 * 16 * 64, 64)},
                     16, "device→cpu", "cpu→device")
    return r


def test_the_modes_are_in_the_registry_and_a_wrong_one_names_the_field():
    assert {"recompute", "swap", "auto"} <= set(preemption_policies.names())
    with pytest.raises(ConfigError, match="engine.preemption"):
        EngineConfig(preemption="sometimes")


def test_a_long_sequence_under_a_busy_queue_is_swapped():
    assert ByCost().swap(Victim(tokens=2000, stored=0, others=8), rates())


def test_a_short_sequence_is_recomputed_when_a_swap_job_costs_more_than_its_prefill():
    r = rates(prefill_us=10.0)
    tokens = int(SWAP_JOB_S / 10e-6 / 4)          # its prefill, even kept waiting by 1 other, is under a swap job
    assert not ByCost().swap(Victim(tokens=tokens, stored=0, others=1), r)


def test_a_sequence_whose_tokens_are_stored_already_is_recomputed_by_loading_them():
    swap, recompute = ByCost.costs(Victim(tokens=2000, stored=2000, others=8), rates())
    assert recompute < swap                        # a load of each token against a copy out and a copy in
    assert not ByCost().swap(Victim(tokens=2000, stored=2000, others=8), rates())


def test_copy_rates_are_taken_only_once_enough_blocks_have_moved():
    r = Rates(kv_bytes_per_token=2048)
    r.observe_copies({"device→cpu": (1.0, 4)}, 16, "device→cpu", "cpu→device")
    assert r.swap_out_s_per_token is None           # four blocks: not a rate yet; the prior stands
    assert r.copy_s_per_token(r.swap_out_s_per_token) == pytest.approx(2048 / 4e9)
    r.observe_copies({"device→cpu": (1.0, 64)}, 16, "device→cpu", "cpu→device")
    assert r.swap_out_s_per_token == pytest.approx(1.0 / (64 * 16))


def test_the_prefill_rate_is_the_slope_of_step_time_over_tokens_not_the_mean():
    r = Rates(kv_bytes_per_token=2048)
    for _ in range(20):                     # decode steps of 16 tokens and prefill steps of 512: 5 ms + 20 µs a token
        r.observe_step(16, 5e-3 + 16 * 20e-6)
        r.observe_step(512, 5e-3 + 512 * 20e-6)
    assert r.prefill_s_per_token == pytest.approx(20e-6, rel=1e-6)
