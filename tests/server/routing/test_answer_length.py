"""The answer length the policy is given: a conversation's earlier answers, else the model's recent
ones, else the prior; max_tokens a cap, min_tokens a floor, ignore_eos the length itself; through
the router, a later turn found by its prefix or its session."""

from __future__ import annotations

from engine.prefix_hash import block_hashes
from server.routing.answer_length import CONVERSATIONS, PRIOR, RECENT, AnswerLengths
from server.routing.policy import Decision, Outcome, Policy
from server.routing.router import Router

BLOCK = 16


def test_the_estimate_before_and_after_answers_are_seen() -> None:
    answers = AnswerLengths()
    assert answers.estimate((), max_tokens=10_000) == PRIOR
    assert answers.estimate((), max_tokens=100) == 100, "max_tokens caps"
    assert answers.estimate((), max_tokens=10_000, min_tokens=400) == 400
    assert answers.estimate((), max_tokens=300, ignore_eos=True) == 300, (
        "ignore_eos: the length is max_tokens"
    )
    assert AnswerLengths(from_max_tokens=True).estimate((40,), 900) == 900, (
        "--answer-length max-tokens"
    )
    for n in (10, 20, 30, 1000):
        answers.answered([], None, (), n)
    assert answers.estimate((), max_tokens=10_000) == 25, (
        "a fresh conversation: the model's recent answers' median"
    )
    assert answers.estimate((400, 500, 600), max_tokens=10_000) == 500, (
        "a continued one: its own answers' median"
    )
    for n in range(RECENT):
        answers.answered([], None, (), 7)
    assert answers.estimate((), max_tokens=10_000) == 7, "only the last RECENT count"


def test_a_later_turn_is_found_by_its_prefix_and_by_its_session() -> None:
    answers = AnswerLengths()
    turn1 = list(range(100, 150))
    answer1 = [7] * 40
    earlier = answers.earlier(block_hashes(turn1, BLOCK), None)
    assert earlier == ()
    answers.answered(block_hashes(turn1 + answer1, BLOCK), None, earlier, len(answer1))
    turn2 = turn1 + answer1 + [300] * 25
    assert answers.earlier(block_hashes(turn2, BLOCK), None) == (40,)
    answers.answered(block_hashes(turn2 + [8] * 60, BLOCK), None, (40,), 60)
    assert answers.earlier(block_hashes(turn2 + [8] * 60 + [301] * 9, BLOCK), None) == (40, 60)
    other = turn1[:BLOCK] + list(
        range(500, 540)
    )  # another conversation, the same first block (a system prompt)
    assert answers.earlier(block_hashes(other, BLOCK), None) == ()
    answers.answered([], "s1", (), 12)
    assert answers.earlier(block_hashes(other, BLOCK), "s1") == (12,), (
        "a session names its conversation"
    )


def test_conversations_are_forgotten_least_recently_used_first() -> None:
    answers = AnswerLengths()
    for i in range(CONVERSATIONS + 10):
        answers.answered([i], None, (), 5)
    assert len(answers.conversations) == CONVERSATIONS
    assert answers.earlier([0], None) == () and answers.earlier([CONVERSATIONS + 9], None) == (5,)


class Recording(Policy):
    def __init__(self) -> None:
        super().__init__("dlocal")
        self.outputs: list[int] = []

    def route(self, cached: int, new: int, output: int, load: int, live, loaded=0) -> Decision:  # type: ignore[override]
        self.outputs.append(output)
        return super().route(cached, new, output, load, live, loaded)


def test_the_router_gives_the_policy_the_estimate_and_learns_each_answer() -> None:
    policy = Recording()
    router = Router(1, BLOCK, policy, 4096)
    history, lengths = list(range(100, 140)), (30, 50, 70)
    for length in lengths:
        placed = router.route(history, [0], max_tokens=4000)  # no max_tokens: the remaining context
        answer = [7] * length
        outcome = Outcome(
            placed.route,
            placed.est_cached_tokens,
            len(history) - placed.est_cached_tokens,
            length,
            50.0,
            10.0,
        )
        router.finished(0, history + answer, placed, outcome)
        history += answer + [200] * 20
    assert policy.outputs == [PRIOR, 30, 40], (
        "turn 1 the prior; then the conversation's answers' median"
    )
    router.route(list(range(900, 960)), [0], max_tokens=4000)
    assert policy.outputs[-1] == 50, "a new conversation: the model's recent answers"
    router.route(history, [0], max_tokens=35)
    assert policy.outputs[-1] == 35, "max_tokens still caps"
