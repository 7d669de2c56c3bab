"""Eviction policies on their own: the order in which each gives keys up."""
import pytest

from tiercache.policies import GuardedTier, admission_policies, eviction_policies


def drain(policy):
    out = []
    while (key := policy.pop_victim()) is not None:
        out.append(key)
    return out


def test_lru_evicts_least_recently_used():
    p = eviction_policies.get("lru")()
    for k in "abcd":
        p.insert(k)
    p.touch("a")
    assert drain(p) == ["b", "c", "d", "a"]


def test_fifo_ignores_hits():
    p = eviction_policies.get("fifo")()
    for k in "abcd":
        p.insert(k)
    p.touch("a")
    assert drain(p) == ["a", "b", "c", "d"]


def test_s3fifo_drops_one_hit_wonders_before_reused_keys():
    p = eviction_policies.get("s3-fifo")()
    for k in range(10):
        p.insert(k)
    p.touch(0)
    p.touch(1)                           # reused while on probation
    victims = [p.pop_victim() for _ in range(8)]
    assert 0 not in victims and 1 not in victims   # promoted to the main queue instead
    assert len(p) == 2


def test_s3fifo_ghosts_come_back_to_the_main_queue():
    p = eviction_policies.get("s3-fifo")()
    for k in "abc":
        p.insert(k)
    assert p.pop_victim() == "a"         # unreused: evicted, remembered as a ghost
    p.insert("a")                        # seen again soon: straight to the main queue
    p.insert("d")
    order = drain(p)
    assert order.index("a") > order.index("b") and order.index("a") > order.index("d")


@pytest.mark.parametrize("name", eviction_policies.names())
def test_every_policy_gives_back_exactly_what_it_holds(name):
    p = eviction_policies.get(name)()
    live = set()
    for k in range(50):
        p.insert(k)
        live.add(k)
        if k % 3 == 0:
            p.touch(k // 2)
        if k % 7 == 0:
            p.remove(k // 3)
            live.discard(k // 3)
    assert len(p) == len(live)
    left = drain(p)
    assert sorted(left) == sorted(live) and len(p) == 0


def test_min_hits_admission():
    admit = admission_policies.get("min-hits")(2)
    assert not admit.admit(b"k", 1) and admit.admit(b"k", 2)
    assert admission_policies.get("always")().admit(b"k", 0)


def test_arc_keeps_reused_keys_through_a_scan():
    p = eviction_policies.get("arc")()
    for k in ("hot1", "hot2"):
        p.insert(k)
        p.touch(k)                        # seen twice: T2
    for i in range(6):
        p.insert(f"scan{i}")              # seen once: T1
    victims = [p.pop_victim() for _ in range(6)]
    assert "hot1" not in victims and "hot2" not in victims


def test_arc_ghost_hits_shift_the_target():
    p = eviction_policies.get("arc")()
    for k in "abcd":
        p.insert(k)
    first = p.pop_victim()                # evicted from T1 into ghost list B1
    assert first == "a" and p._p == 0
    p.insert("a")                         # a ghost hit in B1: recency deserved more room
    assert p._p > 0 and "a" in p._t2


def test_prefix_lru_evicts_orphans_first_then_leaves_before_their_parents():
    from tiercache.policies import eviction_policies
    p = eviction_policies.get("prefix-lru")()
    for k in ("a", "b", "c", "x"):          # a → b → c is one chain, x stands alone (newest)
        p.insert(k)
    p.link("b", "a")
    p.link("c", "b")
    assert p.pop_victim() == "c"            # the oldest, a, still has a child: the chain's tail goes first
    p.insert("c")
    p.link("c", "b")
    p.remove("a")                           # the head leaves: b can never be hit now
    assert p.pop_victim() == "b"
    assert p.pop_victim() == "c"            # and with b gone, c is an orphan too
    assert p.pop_victim() == "x" and p.pop_victim() is None


def test_prefix_lru_a_returning_parent_rescues_its_children():
    from tiercache.policies import eviction_policies
    p = eviction_policies.get("prefix-lru")()
    for k in ("a", "b", "y"):
        p.insert(k)
    p.link("b", "a")
    p.remove("a")
    p.insert("a")                           # recomputed and stored again: b is useful again
    assert p.pop_victim() == "b"            # not as an orphan: as the oldest leaf (a, newer, is b's parent)
    assert [p.pop_victim(), p.pop_victim()] == ["y", "a"]
    assert len(p) == 0


def test_prefix_lru_in_the_trace_replay_is_never_worse_than_lru(shared_trace):
    from tiercache.bench.trace import replay
    trace = shared_trace[:1500]
    lru, prefix = replay(trace, 300_000, "lru"), replay(trace, 300_000, "prefix-lru")
    assert prefix.token_hit_ratio >= lru.token_hit_ratio - 1e-9


def test_frequency_admission_counts_requests_and_forgets_slowly():
    import hashlib

    from tiercache.policies import admission_policies
    a = admission_policies.get("frequency")(1)            # asked for by at least 2 requests
    keys = [hashlib.sha256(bytes([i])).digest() for i in range(200)]
    a.record(keys[:100])
    a.record(keys[:50] + keys[:50])                        # duplicates in one request count once
    assert all(a.admit(k, 0) for k in keys[:50])
    assert sum(a.admit(k, 0) for k in keys[50:]) <= 2      # a sketch may over-count a collision, never under-count
    a._sketch._additions = a._sketch.halve_every - 1       # the next addition ages the sketch: every count halves
    a.record([hashlib.sha256(b"other").digest()])
    assert not a.admit(keys[0], 0)


def test_frequency_admission_writes_less_to_l2_on_the_trace(shared_trace):
    from tiercache.bench.trace import replay_hierarchy
    trace = shared_trace[:1500]
    always = replay_hierarchy(trace, 200_000, 800_000, "always")
    frequency = replay_hierarchy(trace, 200_000, 800_000, "frequency", 1)
    assert frequency.l2_written_chunks < 0.7 * always.l2_written_chunks
    assert frequency.token_hit_ratio > 0


def _keys(n, tag=b""):
    import hashlib
    return [hashlib.sha256(tag + i.to_bytes(4, "big")).digest() for i in range(n)]


def test_count_min_sketch_never_under_counts_and_widening_keeps_estimates():
    import collections
    import random

    from tiercache.policies.sketch import CountMinSketch
    rng = random.Random(5)
    keys = _keys(3000)
    sketch = CountMinSketch(width_bits=10)                  # narrow on purpose: collisions happen
    truth = collections.Counter()
    for _ in range(6000):
        k = rng.choice(keys[:1500])
        truth[k] += 1
        sketch.add_many([k])
    sketch.add_many(keys[1500:])
    truth.update(keys[1500:])
    before = {k: sketch.estimate(k) for k in keys}
    assert all(before[k] >= min(truth[k], sketch.SATURATE) for k in keys)
    sketch.resize(1 << 14)                                  # 2^15 wide now
    assert sketch.width == 1 << 15
    assert {k: sketch.estimate(k) for k in keys} == before
    assert sketch.halve_every == 1 << 14
    sketch.add_many(_keys((1 << 14) - sketch._additions, b"more"))   # the window fills: every count halves
    assert all(sketch.estimate(k) <= (before[k] + 1) // 2 + 1 for k in keys)


def test_raising_counts_in_the_sketch_never_lowers_one_and_saturates():
    from tiercache.policies.sketch import CountMinSketch
    keys = _keys(64)
    sketch = CountMinSketch(width_bits=12)
    sketch.add_many(keys[:32])
    sketch.raise_many(keys[16:48], [5] * 16 + [40] * 16)     # 40: above what a counter holds
    assert [sketch.estimate(k) for k in keys[:16]] == [1] * 16
    assert [sketch.estimate(k) for k in keys[16:32]] == [5] * 16
    assert [sketch.estimate(k) for k in keys[32:48]] == [sketch.SATURATE] * 16
    sketch.raise_many(keys[16:32], [2] * 16)                  # lower than they are: unchanged
    assert [sketch.estimate(k) for k in keys[16:32]] == [5] * 16
    assert all(sketch.estimate(k) == 0 for k in keys[48:])   # 64 keys in 4096 counters: no collision here


@pytest.mark.parametrize("flushed", [False, True])
def test_lfu_da_counts_a_key_exactly_while_it_stays_and_it_comes_back_with_that_count(flushed):
    """Uses are counted on the key while the tier holds it; what it leaves behind (kept aside, then written into
    the sketch ``FLUSH`` keys at a time) is where a key that comes back resumes."""
    p = eviction_policies.get("lfu-da")()
    popular, one_offs = _keys(1, b"p")[0], _keys(3, b"o")
    p.insert(popular)
    for _ in range(4):
        p.touch(popular)                                    # seen five times
    for k in one_offs:
        p.insert(k)
    p.remove(popular)
    if flushed:                                             # enough other keys leave to flush what was kept aside
        others = _keys(p.FLUSH, b"x")
        for k in others:
            p.insert(k)
        for k in others:
            p.remove(k)
    p.insert(popular)                                       # back: its sixth use
    thrice = _keys(3, b"t")
    for k in thrice:
        p.insert(k)
        p.touch(k)
        p.touch(k)
    assert [p.pop_victim() for _ in range(6)] == one_offs + thrice   # it outranks keys used fewer times
    assert p.pop_victim() == popular


def test_lfu_da_keeps_reused_keys_over_one_offs_and_ages_them_out():
    p = eviction_policies.get("lfu-da")()
    popular, one_offs = _keys(4, b"p"), _keys(8, b"o")
    for k in popular:
        p.insert(k)
        p.touch(k)
        p.touch(k)
    for k in one_offs:
        p.insert(k)
    victims = [p.pop_victim() for _ in range(8)]
    assert victims == one_offs                              # equal counts leave oldest first
    for k in _keys(3, b"new"):        # the age is now past one-offs: newcomers asked for three times
        p.insert(k)                   # outrank the old popular keys
        p.touch(k)
        p.touch(k)
    assert p.pop_victim() == popular[0]
    p.remove(popular[1])
    assert popular[1] not in drain(p)


def test_lfu_da_is_the_default_and_beats_lru_on_the_shared_trace(shared_trace):
    from tiercache.bench.trace import replay
    from tiercache.policies import DEFAULT_EVICTION
    assert DEFAULT_EVICTION == "lfu-da"
    trace = shared_trace
    for capacity in (1_000_000, 3_000_000):                 # the two points
        lru, lfu = replay(trace, capacity, "lru"), replay(trace, capacity, DEFAULT_EVICTION)
        assert lfu.token_hit_ratio > 1.02 * lru.token_hit_ratio, capacity


def test_second_sighting_admits_on_the_second_request_within_a_bounded_ghost_history():
    import hashlib

    a = admission_policies.get("second-sighting")(0)
    a.size_for(GuardedTier(5))                                           # a tier of 5 chunks: 40 keys remembered
    assert a.ghost_keys == 40
    keys = [hashlib.sha256(bytes([i])).digest() for i in range(100)]
    a.record(keys[:3])
    assert not any(a.admit(k, 0) for k in keys[:3])         # first sighting: refused
    a.record(keys[:2] + keys[:2])                           # a request counts once per chunk
    assert [a.sightings(k) for k in keys[:3]] == [2, 2, 1]
    assert [a.admit(k, 0) for k in keys[:3]] == [True, True, False]
    for k in keys[3:]:                                      # 97 other requests: the history keeps 40 keys
        a.record([k])
        assert len(a._seen) <= 40
    assert a.sightings(keys[0]) == 0 and not a.admit(keys[0], 0)       # fell off: it starts over
    assert admission_policies.get("second-sighting")(1).admit(keys[0], 1)   # or one L1 hit, with min_hits


def test_a_chain_is_admitted_from_its_head_up_to_the_first_chunk_refused():
    from tiercache.policies import AdmissionPolicy, admitted_prefix

    class Refuses(AdmissionPolicy):
        def __init__(self, refused):
            self.refused = refused

        def admit(self, key, hits):
            return key not in self.refused

    chain = ["a", "b", "c", "d"]
    assert admitted_prefix(None, chain) == 4
    assert admitted_prefix(Refuses({"c"}), chain) == 2      # d would be admitted alone, and never be hit
    assert admitted_prefix(Refuses({"a"}), chain) == 0


def test_second_sighting_in_the_trace_replay_writes_less_and_hits_no_less(shared_trace):
    from tiercache.bench.trace import replay
    trace = shared_trace[:1500]
    lru, guarded = replay(trace, 300_000, "lru"), replay(trace, 300_000, "lru+second-sighting")
    assert guarded.written_chunks < 0.6 * lru.written_chunks            # one-offs are never written
    assert guarded.token_hit_ratio >= lru.token_hit_ratio


def test_lfu_da_state_keeps_a_continuing_requests_chunks_and_gives_up_a_finished_one_offs_first():
    from tiercache.contracts.connector import RequestState

    p = eviction_policies.get("lfu-da-state")()
    reused, chat, one_off = _keys(2, b"r"), _keys(3, b"c"), _keys(3, b"o")
    for k in reused:
        p.insert(k)
        p.touch(k)
    for k in chat + one_off:
        p.insert(k)
    p.retain(chat, RequestState.CONTINUES)           # a conversation's turn: its next turn resends these
    p.retain(one_off + reused[:1], RequestState.FINISHED)   # done; only what it alone asked for is demoted
    victims = drain(p)
    assert victims[:3] == one_off[::-1]              # the one-off first, its tail before its head
    assert set(victims[3:5]) == set(reused)          # then the chunks asked for twice (untouched by the hint)
    assert victims[5:] == chat[::-1]                 # the conversation's last, tail first
    p2 = eviction_policies.get("lfu-da-state")()
    for k in chat:
        p2.insert(k)
    p2.retain(chat[1:], RequestState.PREEMPTED)
    p2.retain(chat[:1], RequestState.CONTINUES)
    assert drain(p2) == [chat[0], chat[2], chat[1]]  # a preempted request's chunks outrank a conversation's


@pytest.mark.parametrize("name", eviction_policies.names())
def test_hints_never_bring_back_a_key_the_policy_does_not_hold(name):
    from tiercache.contracts.connector import RequestState

    p = eviction_policies.get(name)()
    held, gone = _keys(3, b"h"), _keys(2, b"g")
    for k in held + gone:
        p.insert(k)
    for k in gone:
        p.remove(k)
    retain = getattr(p, "retain", None)
    for state in RequestState:
        if retain is not None:
            retain(held + gone, state)
    assert sorted(drain(p)) == sorted(held) and len(p) == 0


def test_second_sighting_takes_a_continuing_conversation_at_its_first_sighting():
    import hashlib

    from tiercache.contracts.connector import RequestState

    a = admission_policies.get("second-sighting")(0)
    a.size_for(GuardedTier(2))                                            # 16 keys remembered
    turn = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    a.record(turn)
    assert not any(a.admit(k, 0) for k in turn)
    a.retain(turn, RequestState.FINISHED)                    # nothing said: still a first sighting
    assert not any(a.admit(k, 0) for k in turn)
    a.retain(turn, RequestState.CONTINUES)
    assert all(a.admit(k, 0) for k in turn)
    for i in range(40):                                      # the vouching is history too: bounded
        a.retain([hashlib.sha256(b"x" + bytes([i])).digest()], RequestState.PREEMPTED)
        assert len(a._seen) <= 16


def _serve(policy, keys, capacity):
    """A tier of ``capacity`` chunks under ``policy`` serves a request: told of it, its held chunks used, the
    rest stored (victims picked as needed)."""
    policy.record(keys)
    for k in keys:
        if k in policy._entries:
            policy.touch(k)
        else:
            while len(policy) >= capacity:
                policy.pop_victim()
            policy.insert(k)


def test_reuse_model_ranks_a_kind_of_request_that_comes_back_above_one_that_does_not():
    p = eviction_policies.get("reuse-model")()
    p.MIN_HORIZON = 64
    for i in range(300):                     # long requests asked for again soon; two-chunk one-offs never
        long, once = _keys(16, b"long%d-" % i), _keys(2, b"once%d-" % i)
        _serve(p, long, 40)
        _serve(p, once, 40)
        _serve(p, long, 40)
    assert p.model.weight(_keys(1, b"long0-")[0], 1) == 1.0             # settled long ago: nothing to go by
    drain(p)
    fresh_long, fresh_once = _keys(16, b"new long"), _keys(2, b"new once")
    _serve(p, fresh_long, 40)
    _serve(p, fresh_once, 40)                # newer, and seen as often: LFU-DA would give up the long one first
    assert sorted([p.pop_victim(), p.pop_victim()]) == sorted(fresh_once)
    assert p.model.weight(fresh_long[0], 1) > 1.0 > p.model.weight(fresh_once[0], 1)


def test_reuse_model_counts_a_reuse_only_within_its_horizon():
    from tiercache.policies.reuse_model import ReuseModel

    model = ReuseModel(horizon=10)
    for i in range(400):        # one-chunk requests back 5 sightings later; two-chunk ones 5 rounds (> 30) later
        soon = _keys(1, b"soon%d" % i)
        model.observe(soon, ())
        model.observe(_keys(4, b"fill%d" % i), ())
        model.observe(soon, ())
        if i % 5 == 0:
            model.observe(_keys(2, b"late%d" % (i // 10)), ())
    one, two = _keys(1, b"new one"), _keys(2, b"new two")
    model.observe(one, ())
    model.observe(two, ())
    assert model.weight(one[0], 1) > 1.0 > model.weight(two[0], 1)


def test_reuse_model_memory_is_bounded_by_its_horizon():
    from tiercache.policies.reuse_model import ReuseModel

    model = ReuseModel(horizon=100)
    for i in range(2000):
        model.observe(_keys(7, b"r%d-" % i), ())
        assert len(model) <= 100 + 7 and len(model._latest) <= 100 + 7
    model.horizon = 1000                     # a tier that grew: the ring grows with it, nothing lost
    for i in range(300):
        model.observe(_keys(7, b"s%d-" % i), ())
    assert 1000 <= len(model) <= 1000 + 7

    policy = eviction_policies.get("reuse-model")()
    policy.MIN_HORIZON, policy.MAX_HORIZON = 8, 64       # however large the tier, the horizon stops there
    for k in _keys(100):
        policy.insert(k)
    policy.record(_keys(3, b"asked"))
    assert policy.model.horizon == 64 and len(policy.model) <= 64 + 3


def test_reuse_model_hears_every_request_through_the_cache_manager():
    from tiercache.manager import CacheManager
    from tiercache.tiers.cpu import CpuIndex
    from tiercache.tiers.metadata import MetadataIndex

    l1 = CpuIndex(8, 1, eviction="reuse-model")
    l2 = MetadataIndex(16, eviction="reuse-model", name="l2")
    manager = CacheManager(l1, block_size=16, blocks_per_chunk=1, block_bytes=1, lower=[l2])
    manager.record_request(_keys(5))
    assert len(l1.policy.model) == len(l2.policy.model) == 5


def test_reuse_model_beats_lru_on_the_shared_trace(shared_trace):
    from tiercache.bench.trace import replay
    for capacity in (1_000_000, 3_000_000):
        lru, learned = replay(shared_trace, capacity, "lru"), replay(shared_trace, capacity, "reuse-model")
        assert learned.token_hit_ratio > 1.01 * lru.token_hit_ratio, capacity


def _digests(n: int, tag: bytes) -> list[bytes]:
    import hashlib
    return [hashlib.sha256(tag + i.to_bytes(4, "big")).digest() for i in range(n)]


def _one_offs_past_a_hot_set(guard, rounds: int) -> None:
    """Each round asks for a hot set of 256 chunks and then for 1024 chunks nobody asks for again: in a tier of
    512 under LRU, admitting the one-offs evicts the hot set before it comes back."""
    hot = _digests(256, b"hot")
    for r in range(rounds):
        for i in range(0, 256, 8):
            guard.record(hot[i:i + 8])
        fresh = _digests(1024, b"once" + r.to_bytes(4, "big"))
        for i in range(0, 1024, 8):
            guard.record(fresh[i:i + 8])


def _each_chunk_back_once_soon(guard, requests: int, tag: bytes) -> None:
    """Every request asks for the 8 chunks of the request before last, then for 8 new ones: whatever is refused
    at its first sighting is a miss at its second, and nothing comes back a third time."""
    keys = [_digests(8, tag + i.to_bytes(4, "big")) for i in range(requests)]
    for i, new in enumerate(keys):
        guard.record((keys[i - 2] if i >= 2 else []) + new)


def test_adaptive_sighting_follows_whichever_rule_its_shadow_tiers_say_misses_less():
    from tiercache.policies.admission import DUEL_BOUND, MAX_SHADOW_SLOTS, SHADOW_SLOTS

    guard = admission_policies.get("adaptive-sighting")(0)
    guard.size_for(GuardedTier(512))
    stranger = _digests(1, b"stranger")[0]
    assert guard.admits_all and guard.admit(stranger, 0)           # no evidence yet: the tier's own policy
    _one_offs_past_a_hot_set(guard, rounds=4)
    assert not guard.admits_all and guard.duel == -DUEL_BOUND      # refusing one-offs keeps the hot set
    assert not guard.admit(stranger, 0) and guard.admit(_digests(256, b"hot")[0], 0)
    _each_chunk_back_once_soon(guard, 600, b"soon")
    assert guard.admits_all and guard.admit(stranger, 0)           # refusing first sightings now loses hits
    _one_offs_past_a_hot_set(guard, rounds=4)
    assert not guard.admits_all                                    # and back
    assert guard._always.slots == guard._picky.slots == SHADOW_SLOTS
    huge = admission_policies.get("adaptive-sighting")(0)
    huge.size_for(GuardedTier(1 << 30, 1 << 28))                   # memory bounded whatever the tiers' size
    assert huge._always.slots == MAX_SHADOW_SLOTS and huge._l1.slots == MAX_SHADOW_SLOTS // 4
    assert huge.ghost_keys <= 1 << 22
    from tiercache.policies import guards_entry
    assert guards_entry("adaptive-sighting")


def test_adaptive_sighting_takes_most_of_second_sightings_gain_where_admitting_everything_loses(shared_trace):
    from tiercache.bench.trace import replay
    trace = shared_trace[:1500]                # at 500K, LFU-DA admitting everything is below LRU (RESULTS.md)
    lru, lfu = (replay(trace, 500_000, p).token_hit_ratio for p in ("lru", "lfu-da"))
    picky = replay(trace, 500_000, "lfu-da+second-sighting").token_hit_ratio
    adaptive = replay(trace, 500_000, "lfu-da+adaptive-sighting").token_hit_ratio
    assert lfu < lru < adaptive <= picky and adaptive - lfu > 0.6 * (picky - lfu)
