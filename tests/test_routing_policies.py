"""Routing policies on their own: how each ranks replicas for one request (no sockets)."""
from tiercache.fleet.prefix_index import CachedTokens
from tiercache.fleet.routing import Candidate, ReplicaRates, routing_policies

RATES = ReplicaRates(prefill=1000.0, load={"CPU": 20000.0})


def replica(name: str, cached: int, waiting: int, prompt: int = 1000) -> Candidate:
    return Candidate(name, prompt, CachedTokens(cached), in_flight=waiting // prompt, pending_prefill=waiting,
                     pending_prefill_s=waiting / RATES.prefill, rates=RATES)


def order(policy: str, *candidates: Candidate) -> list[str]:
    return [r.name for r in routing_policies.get(policy)().rank(list(candidates))]


def test_expected_ttft_weighs_a_hit_against_the_queue_in_front_of_it():
    # a holds 900 of 1000 tokens (0.1 s to compute) behind 0.5 s of queue; b holds none, idle: 1.0 s
    assert order("expected-ttft", replica("a", 900, 500), replica("b", 0, 0)) == ["a", "b"]
    # behind 1.5 s of queue, a's hit is worth less than b's idle compute
    assert order("expected-ttft", replica("a", 900, 1500), replica("b", 0, 0)) == ["b", "a"]


def test_the_hotspot_guard_trips_at_two_replicas_against_the_other_replicas_queue():
    """a holds the whole prompt (nothing to compute) behind 0.8 s of queue; b, idle, would compute it all in
    1.0 s. a wins on expected time, but its queue is past twice b's plus the request's mean compute over the
    two (0.5 s): it is a hotspot, and b goes first. Behind 0.4 s it is not."""
    hot, idle = replica("a", 1000, 800), replica("b", 0, 0)
    estimates = {r.name: r.expected_ttft_s for r in routing_policies.get("least-loaded")().rank([hot, idle])}
    assert estimates["a"] < estimates["b"]                              # a wins on expected time alone...
    assert order("expected-ttft", hot, idle) == ["b", "a"]              # ...and is a hotspot: b first
    assert order("expected-ttft", replica("a", 1000, 400), idle) == ["a", "b"]   # within the guard: a
    assert order("expected-ttft", replica("a", 1000, 0), replica("b", 0, 0)) == ["a", "b"]   # an idle fleet
    assert order("expected-ttft", hot) == ["a"]                         # alone: nothing to spread to


def test_a_near_tie_goes_to_the_replica_sent_the_fewest_tokens_not_to_the_first_name():
    """Every replica idle and holding the system prompt: a new conversation is a tie, and it goes where the
    fewest tokens have gone (by name it would always be "a"). A real difference is never overturned."""
    def sent(name: str, cached: int, routed: int) -> Candidate:
        return Candidate(name, 1000, CachedTokens(cached), 0, 0, 0.0, RATES, recent_tokens=routed)
    policy = routing_policies.get("expected-ttft")()
    assert [r.name for r in policy.rank([sent("a", 600, 9000), sent("b", 600, 100), sent("c", 600, 5000)])] \
        == ["b", "c", "a"]
    assert [r.name for r in policy.rank([sent("a", 600, 9000), sent("b", 590, 100)])] == ["b", "a"]  # within 15 %
    # a holds the conversation's history (0.1 s left to compute), b only the system prompt (0.4 s): a, though
    # it has been sent a little more
    assert [r.name for r in policy.rank([sent("a", 900, 11000), sent("b", 600, 10000)])] == ["a", "b"]


def test_the_share_guard_spreads_a_prefix_one_replica_holds_but_keeps_a_long_history_where_it_is():
    """a alone holds a system prompt (1200 tokens) and has been sent twice the mean of the fleet's tokens (20000
    over it): a new conversation on it (1500 tokens) moves to the replica sent the fewest, for 1200 more tokens
    of prefill — within a tenth of the excess. Within its share a keeps it, and so it does when the excess is
    small; a long conversation whose 4000-token history is on a stays there (moving it would recompute 4000)."""
    def sent(name: str, prompt: int, cached: int, routed: int) -> Candidate:
        return Candidate(name, prompt, CachedTokens(cached), 0, 0, 0.0, RATES, recent_tokens=routed)
    policy = routing_policies.get("expected-ttft")()
    fleet = [sent("a", 1500, 1200, 40000), sent("b", 1500, 0, 15000), sent("c", 1500, 0, 5000)]
    assert [r.name for r in policy.rank(fleet)][0] == "c"
    within = [sent("a", 1500, 1200, 22000), sent("b", 1500, 0, 20000), sent("c", 1500, 0, 18000)]
    assert [r.name for r in policy.rank(within)][0] == "a"                # 1.1 times the mean: a
    early = [sent("a", 1500, 1200, 4000), sent("b", 1500, 0, 1500), sent("c", 1500, 0, 500)]
    assert [r.name for r in policy.rank(early)][0] == "a"                 # twice the mean, 2000 over it: a
    long = [sent("a", 4300, 4000, 40000), sent("b", 4300, 0, 15000), sent("c", 4300, 0, 5000)]
    assert [r.name for r in policy.rank(long)][0] == "a"
    assert [r.name for r in routing_policies.get("expected-ttft")(share_slack=1e9).rank(fleet)][0] == "a"


def test_expected_ttft_names_the_rule_that_put_its_first_replica_first():
    """Each answer's X-Tiercache-Route-Reason: the fastest estimate, a near tie, the hotspot guard, the share
    guard (the cases of the tests above)."""
    def first(*candidates: Candidate) -> tuple[str, str]:
        top = routing_policies.get("expected-ttft")().rank(list(candidates))[0]
        return top.name, top.reason

    def sent(name: str, prompt: int, cached: int, routed: int) -> Candidate:
        return Candidate(name, prompt, CachedTokens(cached), 0, 0, 0.0, RATES, recent_tokens=routed)
    assert first(replica("a", 900, 500), replica("b", 0, 0)) == ("a", "fastest")
    assert first(replica("a", 1000, 800), replica("b", 0, 0)) == ("b", "hotspot")
    assert first(sent("a", 1000, 600, 9000), sent("b", 1000, 590, 100)) == ("b", "tie")
    assert first(sent("a", 1500, 1200, 40000), sent("b", 1500, 0, 15000), sent("c", 1500, 0, 5000)) \
        == ("c", "share")
    assert first(replica("a", 1000, 800)) == ("a", "fastest")              # alone: first because it is fastest
    assert all(r.reason == "" for r in routing_policies.get("least-loaded")().rank([replica("a", 0, 0)]))


def test_a_replicas_first_measured_prefill_rate_replaces_the_configured_guess():
    """The router starts from a configured rate (20K tokens/s); a replica's first idle first token measured at
    2K tokens/s is its rate from then on, not a tenth of the way there (a fresh fleet's estimates would be
    several times too low for its first dozen requests). Measurements that cannot tell the per-token part from
    the attention part (all without context here) give one rate, their least-squares ratio."""
    from tiercache.fleet.replicas import PREFILL_DECAY, Replica

    r = Replica("r", "http://r", ReplicaRates(20_000.0, {"CPU": 400_000.0}))
    r.learn_prefill(200, 0, 0.1)
    assert r.rates.prefill == 2_000.0 and r.rates.attention_s == 0.0 and r.rates.load == {"CPU": 400_000.0}
    r.learn_prefill(200, 0, 0.05)                             # 4K tokens/s: least squares of the relative error
    assert r.rates.prefill == (2_000.0 ** 2 * PREFILL_DECAY + 4_000.0 ** 2) / (2_000.0 * PREFILL_DECAY + 4_000.0)
    before = r.rates
    r.learn_prefill(0, 500, 0.1)                              # a full hit computes nothing: it teaches nothing
    assert r.rates == before


def test_the_prefill_cost_grows_with_the_context_it_attends_to_and_the_fit_finds_both_parts():
    """A replica whose prefill costs 0.2 ms a token plus 0.1 µs per pair (computed token, token it attends to),
    measured on short turns after long histories and long prompts after none: the fit finds both parts, so it
    estimates a 3000-token recompute and a 300-token turn after a 3000-token history alike — one rate fitted to
    the same measurements is a fifth or more off on one of them (a share guard or a tie trusting it misjudges
    what moving a conversation away from its history costs)."""
    import math

    from tiercache.fleet.replicas import Replica

    def true_s(n: int, c: int) -> float:
        return n * 2e-4 + n * (c + n / 2) * 1e-7

    seen = [(300, 1200), (1500, 0), (300, 3400), (700, 2000), (1500, 0), (200, 4000)] * 3
    r = Replica("r", "http://r", ReplicaRates(20_000.0))
    for n, c in seen:
        r.learn_prefill(n, c, true_s(n, c))
    assert math.isclose(r.rates.prefill, 5_000.0, rel_tol=1e-6)
    assert math.isclose(r.rates.attention_s, 1e-7, rel_tol=1e-6)
    probes = [(3000, 0), (300, 3000)]
    assert all(math.isclose(r.rates.prefill_s(n, c), true_s(n, c), rel_tol=1e-6) for n, c in probes)
    one_rate = ReplicaRates(sum(n * n for n, _ in seen) / sum(n * true_s(n, c) for n, c in seen))   # least squares
    assert max(abs(one_rate.prefill_s(n, c) / true_s(n, c) - 1) for n, c in probes) > 0.2
    # a candidate's estimate uses it: 300 new tokens after a 3000-token history cost more than after none
    ranked = routing_policies.get("least-loaded")().rank([
        Candidate("long", 3300, CachedTokens(3000), 0, 0, 0.0, r.rates),
        Candidate("short", 300, CachedTokens(0), 0, 0, 0.0, r.rates)])
    assert {x.name: round(x.prefill_s, 6) for x in ranked} == {"long": round(true_s(300, 3000), 6),
                                                              "short": round(true_s(300, 0), 6)}


def test_prefill_measurements_that_find_a_negative_part_fall_back_to_one_rate():
    """Noise can make the two-part fit say attention (or the per-token part) is free or negative: then one
    rate, never a negative time."""
    from tiercache.fleet.replicas import Replica

    r = Replica("r", "http://r", ReplicaRates(20_000.0))
    for n, c, s in [(300, 3000, 0.05), (1500, 0, 0.5), (300, 3000, 0.05), (1500, 0, 0.5)]:
        r.learn_prefill(n, c, s)          # the long-context turns are *faster* per token: no attention part
    assert r.rates.attention_s == 0.0 and r.rates.prefill > 0
    assert r.rates.prefill_s(300, 3000) > 0


def test_a_replicas_share_is_its_recent_traffic_each_token_fading_with_age():
    """What the tie rule and the share guard compare: tokens sent, each counting exp(-age / window) — an excess
    of the same proportion stays the same size however long the router has run."""
    import math

    from tiercache.fleet.replicas import DecayingSum

    recent = DecayingSum(window_s=10.0)
    assert recent.read(5.0) == 0.0
    recent.add(1000, now=100.0)
    assert recent.read(100.0) == 1000
    assert math.isclose(recent.read(110.0), 1000 / math.e)
    recent.add(500, now=110.0)
    assert math.isclose(recent.read(120.0), (1000 / math.e + 500) / math.e)
    assert recent.read(90.0) == recent.value                  # a clock read before the last add: no growth
    # sending 1000 tokens every second converges to 1000 / (1 - exp(-1 / window)), not to an ever larger count
    steady = DecayingSum(window_s=10.0)
    for t in range(600):
        steady.add(1000, now=float(t))
    assert math.isclose(steady.read(599.0), 1000 / (1 - math.exp(-0.1)), rel_tol=1e-9)


def test_the_prefill_ahead_of_a_request_is_what_was_sent_less_what_the_replica_has_worked_off_since():
    """A replica works on its pending prefills while it has any: a request sent 150 ms into a 200 ms prefill
    waits 50 ms, not 200; a first token takes its request's estimate out with the work credited to it; idle
    time is never banked against the next request."""
    import math

    from tiercache.fleet.replicas import ReplicaLoad

    load = ReplicaLoad()
    assert load.waiting_prefill_s(0.0) == 0.0
    load.sent(200, 0.2, 1000, now=0.0)
    assert math.isclose(load.waiting_prefill_s(0.15), 0.05)
    load.sent(100, 0.1, 1000, now=0.15)
    assert math.isclose(load.waiting_prefill_s(0.15), 0.15)
    assert load.waiting_prefill_s(0.5) == 0.0                  # both should be done: no negative wait
    load.prefilled(200, 0.2, now=0.5)                          # ran long: the second is taken as worked off
    assert math.isclose(load.waiting_prefill_s(0.5), 0.0)
    assert math.isclose(load.waiting_prefill_s(0.55), 0.0)
    load.finished(100, 0.1, now=0.55)                          # failed before its first token
    load.finished(0, 0.0, now=0.6)                             # the first one's stream ends
    assert (load.in_flight, load.pending_prefill, load.waiting_prefill_s(0.6)) == (0, 0, 0.0)
    load.sent(300, 0.3, 1000, now=10.0)                        # after 9.4 s idle: the whole estimate is ahead
    assert math.isclose(load.waiting_prefill_s(10.0), 0.3)
    load.prefilled(300, 0.3, now=10.1)                         # came early (0.1 s): the credit does not go
    assert (load.worked_s, load.pending_prefill_s) == (0.0, 0.0)           # negative or carry over
    assert (load.requests, load.prompt_tokens) == (3, 3000)


def test_requests_a_replica_reports_beyond_the_routers_own_are_foreign_load_in_its_estimate():
    """A replica's /metrics says what its engine holds (vLLM's gauges or tiercache api's); what it holds beyond
    the requests this router could have there — a second router's, a client's calling it directly — is waited
    for as well: each like a request in flight, those not started also for a prefill of this router's mean."""
    import math

    from tiercache.fleet.engine_queue import EngineQueue, engine_queue
    from tiercache.fleet.replicas import ReplicaLoad
    from tiercache.fleet.routing import estimate

    vllm = ("# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
            'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0\n'
            "vllm:num_requests_swapped 7\n")
    assert engine_queue(vllm) == EngineQueue(running=3, waiting=4)
    assert engine_queue("tiercache_engine_requests_running 1.0\ntiercache_engine_requests_waiting 0.0\n") \
        == EngineQueue(1, 0)
    assert engine_queue("tiercache_engine_steps_total 5.0\n") is None           # nothing it knows
    assert engine_queue("tiercache_engine_requests_running NaN\n") is None      # not a count

    load = ReplicaLoad()
    load.sent(100, 0.2, 1000, now=0.0)
    load.sent(100, 0.4, 1000, now=0.0)
    load.reported(EngineQueue(running=2, waiting=0), own=load.in_flight)       # its own two: nothing foreign
    assert (load.foreign, load.foreign_prefill_s()) == (0, 0.0)
    load.reported(EngineQueue(running=3, waiting=3), own=load.in_flight)       # four more, three not started
    assert (load.foreign, load.foreign_waiting) == (4, 3)
    assert math.isclose(load.foreign_prefill_s(), 3 * (0.9 * 0.2 + 0.1 * 0.4))
    assert load.engine_requests == 6
    load.reported(None, own=load.in_flight)                                    # no report: no foreign load
    assert (load.foreign, load.engine_requests) == (0, -1)

    busy = Candidate("busy", 1000, CachedTokens(0), 0, 0, 0.0, RATES, foreign=4, foreign_prefill_s=0.5)
    idle = Candidate("idle", 1000, CachedTokens(0), 0, 0, 0.0, RATES)
    assert math.isclose(estimate(busy).queue_s, 0.5 + 4 * RATES.per_request_s)
    assert estimate(idle).queue_s == 0.0
    assert order("expected-ttft", busy, idle)[0] == "idle"


def test_what_a_running_request_adds_to_a_new_ones_wait_is_learned_from_busy_first_tokens():
    """The configured 2 ms per running request until a busy first token is measured; then the slope of the
    excess wait over the requests running, recent measurements first, never negative."""
    import math

    from tiercache.fleet.replicas import RunningCost

    fit = RunningCost()
    assert fit.rates(RATES) is RATES
    fit.observe(0.5, running=0)                                # an idle first token says nothing of it
    assert fit.rates(RATES) is RATES
    for running in (1, 2, 3, 1, 2):
        fit.observe(0.03 * running, running)
    assert math.isclose(fit.rates(RATES).per_request_s, 0.03)
    assert fit.rates(RATES).prefill == RATES.prefill
    for _ in range(200):                                       # the replica got faster: the old slope fades
        fit.observe(0.01 * 2, 2)
    assert math.isclose(fit.rates(RATES).per_request_s, 0.01, rel_tol=1e-3)
    for _ in range(400):                                       # waits under the estimate: no negative cost
        fit.observe(-0.05, 1)
    assert fit.rates(RATES).per_request_s == 0.0


def test_a_replica_that_joins_a_busy_fleet_takes_its_share_within_a_few_windows_not_everything_for_hours():
    """Two replicas have served 1000 prompt tokens a second for an hour; a third joins, idle and empty. Requests
    that no replica holds are near ties, taken by the replica with the smallest share: with recent shares the
    newcomer takes the first ones and about a third of them three windows later; with counts since the start
    (a window too long to fade, as the router had) it would still be taking every one."""
    from tiercache.fleet.replicas import DecayingSum

    def newcomer_shares(window_s: float) -> tuple[float, float]:
        sums = {name: DecayingSum(window_s=window_s) for name in ("a", "b", "new")}
        for t in range(3600):                                     # the hour before: 500 tokens/s to each
            sums["a"].add(500, float(t))
            sums["b"].add(500, float(t))
        policy, taken = routing_policies.get("expected-ttft")(), []
        for i in range(4 * 30 * 2):                               # four windows of 30 s, a request each 0.5 s
            now = 3600.0 + i / 2
            top = policy.rank([Candidate(n, 500, CachedTokens(0), 0, 0, 0.0, RATES, recent_tokens=s.read(now))
                               for n, s in sums.items()])[0].name
            sums[top].add(500, now)
            taken.append(top == "new")
        return sum(taken[:20]) / 20, sum(taken[180:]) / 60         # its first 10 s, and the fourth window
    first, later = newcomer_shares(30.0)
    assert first == 1.0 and 0.25 <= later <= 0.42
    assert newcomer_shares(1e12) == (1.0, 1.0)


def test_the_router_passes_a_requests_session_on_to_the_replica():
    """vLLM's X-Session-ID tells a replica's tiers the request belongs to a conversation; the router keeps it."""
    from aiohttp.test_utils import make_mocked_request

    from tiercache.fleet.router import _forwarded_headers
    told = _forwarded_headers(make_mocked_request("POST", "/v1/completions", headers={"X-Session-ID": "chat-1"}))
    assert told["X-Session-ID"] == "chat-1"
    assert "X-Session-ID" not in _forwarded_headers(make_mocked_request("POST", "/v1/completions"))


def test_a_session_goes_back_to_its_replica_unless_it_is_gone_or_has_fallen_far_behind():
    from tiercache.fleet.routing import STICKY_SLACK, prefer_session_replica

    a, b, c = (replica(n, 0, waiting) for n, waiting in (("a", 0), ("b", 500), ("c", 5000)))
    ranking = routing_policies.get("least-loaded")().rank([a, b, c])          # a 1.0 s, b 1.5 s, c 6.0 s
    assert [r.name for r in prefer_session_replica(ranking, "b")] == ["b", "a", "c"]   # within twice the best: its own
    assert prefer_session_replica(ranking, "b")[0].reason == "sticky"
    assert [r.name for r in prefer_session_replica(ranking, "c")] == ["a", "b", "c"]   # six times the best: it moves on
    assert [r.name for r in prefer_session_replica(ranking, "a")] == ["a", "b", "c"]
    assert [r.name for r in prefer_session_replica(ranking, "gone")] == ["a", "b", "c"]   # down, or another model's
    assert [r.name for r in prefer_session_replica(ranking, None)] == ["a", "b", "c"]
    assert STICKY_SLACK == 2.0


def test_the_routers_session_memory_is_bounded_and_forgets_the_least_recently_used():
    from tiercache.fleet.router import Sessions
    sessions = Sessions(limit=3)
    for i in range(3):
        sessions.put(("acme", f"s{i}"), f"r{i}")
    assert sessions.get(("acme", "s0")) == "r0"          # used: now the most recent
    sessions.put(("acme", "s3"), "r3")
    assert len(sessions) == 3 and sessions.get(("acme", "s1")) is None
    assert sessions.get(("initech", "s0")) is None      # a session is a tenant's: another's of that name is not it
    assert [sessions.get(("acme", s)) for s in ("s0", "s2", "s3")] == ["r0", "r2", "r3"]
