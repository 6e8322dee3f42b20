"""Scheduler policy: torch-free, milliseconds."""
import subprocess
import sys

import pytest

from engine.api import GenerateRequest, ThinkingBudget
from engine.scheduler import Scheduler, Sequence, Status


def seq(n, max_new=4, ckpts=(), stop=frozenset(), forced=None):
    return Sequence.from_request(GenerateRequest(list(range(1, n + 1)), max_new, stop_ids=stop,
                                                 checkpoint_positions=ckpts, forced_output_ids=forced))


def test_admits_up_to_max_running_in_fifo_order():
    s = Scheduler(max_running=2, max_step_tokens=64)
    seqs = [seq(5) for _ in range(3)]
    for q in seqs:
        s.add(q)
    assert s.admit() == seqs[:2]
    assert [q.status for q in seqs] == [Status.RUNNING, Status.RUNNING, Status.WAITING]
    s.remove(seqs[0], "stop")
    assert s.admit() == [seqs[2]]


def test_prefill_is_chunked_by_budget_and_carries_the_checkpoints_inside_each_chunk():
    s = Scheduler(max_running=4, max_step_tokens=16)
    q = seq(40, ckpts=(10, 16, 30))
    s.add(q)
    s.admit()
    spans = []
    while q.prefilling:
        (w,) = s.schedule()
        spans.append((w.start, w.end, w.checkpoint_positions, w.checkpoint_here))
        s.advance(w, 7 if w.samples else None)
    # checkpoints do not cut chunks: 10 is marked inside the first, 16 is its end, 30 inside the third
    assert spans == [(0, 16, (10,), True), (16, 32, (30,), False), (32, 40, (), True)]
    assert q.tokens[-1] == 7 and q.num_output == 1


def test_decodes_go_first_and_prefill_gets_the_rest_of_the_budget():
    s = Scheduler(max_running=4, max_step_tokens=8)
    a, b = seq(3), seq(20)
    s.add(a)
    s.admit()
    (w,) = s.schedule()
    s.advance(w, 9)  # a's prompt done, first token sampled
    s.add(b)
    s.admit()
    work = s.schedule()
    assert [(x.seq, x.start, x.end) for x in work] == [(a, 3, 4), (b, 0, 7)]


def test_stop_id_length_and_forced_outputs_finish_correctly():
    s = Scheduler()
    q = seq(2, max_new=5, stop=frozenset({0}))
    s.add(q)
    s.admit()
    (w,) = s.schedule()
    assert s.advance(w, 0) == "stop" and q.tokens == [1, 2]  # stop token is not appended
    q = seq(2, max_new=2)
    s.add(q)
    s.admit()
    s.remove(s.running[0], "stop")
    results = [s.advance(w, t) for w, t in ((s.schedule()[0], 5), (s.schedule()[0], 6))]
    assert results == [None, "length"]
    q = seq(2, max_new=10, stop=frozenset({0}), forced=[0, 3])
    s.remove(s.running[0], "length")
    s.add(q)
    s.admit()
    assert s.advance(s.schedule()[0], 0) is None  # forced ids are emitted even if they are stop ids
    assert s.advance(s.schedule()[0], 3) == "stop"


def _decode(s: Scheduler, q: Sequence, sampled: list[int]) -> list[int]:
    """Run q's steps, the model 'sampling' `sampled` in turn, the sequence's forced ids taking their place."""
    s.add(q)
    s.admit()
    for token in sampled:
        (w,) = s.schedule()
        forced = q.forced_token() if w.samples else None
        s.advance(w, forced if forced is not None else token)
    return q.tokens[q.num_prompt:]


def test_thinking_past_its_budget_is_closed_by_the_engine_then_the_answer_follows():
    """Budget 3, think-end marker [90, 91]: three tokens of thinking, then both marker ids forced in place of
    what the model sampled, then the model's own answer; no chained step may sample across the forcing."""
    budget = ThinkingBudget(3, close_ids=(90, 91))
    q = Sequence.from_request(GenerateRequest([1, 2], 20, thinking_budget=budget))
    s = Scheduler()
    s.add(q)
    s.admit()
    soon = []
    for token in [5, 6, 7, 8, 9, 10, 11]:
        (w,) = s.schedule()
        soon.append(q.forced_soon())
        forced = q.forced_token()
        s.advance(w, forced if forced is not None else token)
    assert q.tokens[2:] == [5, 6, 7, 90, 91, 10, 11] and q.thinking_since is None
    assert soon == [False, False, True, True, True, False, False]
    # a model that closes its thinking in time is left alone
    q = Sequence.from_request(GenerateRequest([1, 2], 20, thinking_budget=budget))
    assert _decode(Scheduler(), q, [5, 90, 91, 8, 9, 10]) == [5, 90, 91, 8, 9, 10]


def test_a_thinking_budget_counts_from_where_the_output_opens_its_thinking():
    budget = ThinkingBudget(2, close_ids=(91,), open_ids=(80,))
    q = Sequence.from_request(GenerateRequest([1, 2], 20, thinking_budget=budget))
    assert _decode(Scheduler(), q, [5, 6, 7, 80, 8, 9, 10, 11]) == [5, 6, 7, 80, 8, 9, 91, 11]
    q = Sequence.from_request(GenerateRequest([1, 2], 20, thinking_budget=budget, forced_output_ids=[80, 8, 9, 7]))
    assert _decode(Scheduler(), q, [0, 0, 0, 0]) == [80, 8, 9, 7]  # a replay's script is the whole output


def test_prefill_only_request_finishes_with_length_when_prompt_is_computed():
    s = Scheduler(max_step_tokens=4)
    q = seq(6, max_new=0)
    s.add(q)
    s.admit()
    assert s.advance(s.schedule()[0], None) is None
    assert s.advance(s.schedule()[0], None) == "length"


def prompt(shared, tail, n=1000):
    return Sequence.from_request(GenerateRequest(list(range(1, shared + 1)) + [n + k for k in range(tail)], 4))


def test_a_sequence_sharing_a_prefix_in_flight_waits_for_its_prefill():
    s = Scheduler(max_running=4, max_step_tokens=64, share_min=32)
    lead, small, other, close = prompt(300, 20), prompt(20, 20, 2000), prompt(0, 50, 3000), prompt(300, 20, 4000)
    for q in (lead, small, other, close):
        s.add(q)
    s.admit()
    assert [s.follow(q) for q in (lead, small, other, close)] == [False, False, False, True]
    assert (close.leader, close.shared_at) == (lead, 300) and 300 in lead.checkpoint_positions
    three = prompt(300, 40, 5000)  # followers never lead: the next one waits for the same prefill
    s.running.append(three)
    assert s.follow(three) and three.leader is lead
    spans = []
    while lead.prefilling:
        work = s.schedule()
        assert close not in [w.seq for w in work] and three not in [w.seq for w in work]
        spans += [(w.start, w.end, w.checkpoint_positions, w.checkpoint_here) for w in work if w.seq is lead]
        for w in work:
            s.advance(w, 7 if w.samples else None)
        ready = s.ready_followers()
        assert ready == ([] if lead.num_computed < 300 else [close, three])
        if ready:
            break
    assert (256, 320, (300,), True) in spans  # the leader snapshots where they part, inside its chunk
    assert close.leader is None and three.leader is None


def test_a_follower_is_let_go_when_its_leader_goes_and_small_gains_do_not_wait():
    s = Scheduler(max_running=4, max_step_tokens=64, share_min=100)
    lead, follower = prompt(300, 20), prompt(300, 5, 2000)
    for q in (lead, follower):
        s.add(q)
    s.admit()
    s.follow(lead)
    assert s.follow(follower)
    s.remove(lead, "abort")
    assert s.ready_followers() == [follower] and not s.follow(follower)
    s = Scheduler(max_running=4, max_step_tokens=64, share_min=100)
    ahead, late = prompt(300, 20, 3000), prompt(300, 20, 4000)
    ahead.num_computed = 300  # already past where they part, with no checkpoint there
    s.running += [ahead, late]
    assert not s.follow(late)
    ahead.num_computed, late.num_computed = 100, 250  # late has 250 from the cache: 50 to gain < share_min
    assert not s.follow(late)
    late.num_computed = 150
    assert s.follow(late)
    off = Scheduler(share_min=0)
    off.running += [ahead, late]
    assert not off.follow(late)


def test_bad_configuration_is_a_value_error():
    with pytest.raises(ValueError, match="max_running"):
        Scheduler(max_running=0)
    with pytest.raises(ValueError, match="checkpoint positions"):
        GenerateRequest([1, 2], 1, checkpoint_positions=(3,))


def test_scheduler_and_api_import_no_torch():
    code = "import engine.scheduler, engine.serving, engine.api, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_short_prompt_tail_rides_with_the_chunk_before_it():
    def chunks_of(n: int) -> list[int]:
        s = Scheduler(max_running=4, max_step_tokens=16)
        seq = Sequence.from_request(GenerateRequest(prompt_ids=list(range(n)), max_new_tokens=1))
        s.add(seq)
        s.admit()
        out = []
        while seq.prefilling:
            (item,) = s.schedule()
            out.append(item.end - item.start)
            s.advance(item, 5 if item.end == seq.num_prompt else None)
        return out

    assert chunks_of(34) == [16, 18]  # the 2-token tail (<= 16 // 8) joins the last full chunk
    assert chunks_of(35) == [16, 16, 3]  # a 3-token tail is a step of its own
    assert chunks_of(32) == [16, 16]
