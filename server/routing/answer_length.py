"""How long a request's answer will be, as the policy needs it.

The policy weighs an inline append's cost per output token (server/routing/policy.py), so it needs
the answer's length before the answer exists. `max_tokens` is a cap, not that length: without one
(the OpenAI SDK's default) it is the whole remaining context, and a generous cap is no closer. So
the router estimates it:

- a request that continues a conversation (a later turn, found by its `x-session-id`, or by the
  chained block hashes of its prompt, which hold the earlier turn's prompt and answer as a prefix
  wherever the answer came back as the same tokens, as a Responses API `previous_response_id` or a
  client resending the history does) is expected to answer like that conversation's earlier turns:
  their median;
- anything else like the served model's recent answers (the median of the last RECENT);
- before any answer has been seen, PRIOR tokens (about a chat answer's typical length);

never more than `max_tokens` nor less than `min_tokens`, and exactly `max_tokens` for `ignore_eos`,
where it is the length (and with `from_max_tokens`, `ppd serve --answer-length max-tokens`, for
every request: the reading before the estimate, for clients that send the true length). Each API
server keeps its own history (several API servers each learn from the requests they serve).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from statistics import median

PRIOR = 256  # tokens, before any answer has been seen
RECENT = 256  # the served model's answers a fresh conversation is estimated from
TURNS = 8  # a conversation's answers kept, the latest
CONVERSATIONS = 65536  # conversations remembered, the least recently used forgotten first


class AnswerLengths:
    def __init__(self, prior: int = PRIOR, from_max_tokens: bool = False) -> None:
        self.prior, self.from_max_tokens = prior, from_max_tokens
        self.recent: deque[int] = deque(maxlen=RECENT)
        self.conversations: OrderedDict[Hashable, tuple[int, ...]] = OrderedDict()

    def earlier(self, hashes: Sequence[int], session: str | None) -> tuple[int, ...]:
        """The answer lengths of the conversation a prompt continues, oldest first (empty: none
        known). hashes are the prompt's chained block hashes: the longest prefix that ended an
        earlier turn names its conversation."""
        keys = [("session", session)] if session is not None else []
        for key in [*keys, *reversed(hashes)]:
            found = self.conversations.get(key)
            if found is not None:
                self.conversations.move_to_end(key)
                return found
        return ()

    def estimate(
        self,
        earlier: tuple[int, ...],
        max_tokens: int,
        min_tokens: int = 0,
        ignore_eos: bool = False,
    ) -> int:
        """The answer length the policy should assume for a request whose conversation answered
        `earlier`."""
        if ignore_eos or self.from_max_tokens:
            return max_tokens
        guess = median(earlier) if earlier else median(self.recent) if self.recent else self.prior
        return max(1, min(max_tokens, max(min_tokens, round(guess))))

    def answered(
        self, hashes: Sequence[int], session: str | None, earlier: tuple[int, ...], length: int
    ) -> None:
        """A request ended with an answer of `length` tokens: remember it for its conversation's
        next turn, under the last full block of its prompt and answer (hashes: theirs, chained; a
        prompt's own last block may still be a system prompt that many conversations share) and
        its session, and among the model's recent answers."""
        self.recent.append(length)
        answers = (*earlier, length)[-TURNS:]
        keys = ([hashes[-1]] if hashes else []) + (
            [("session", session)] if session is not None else []
        )
        for key in keys:
            self.conversations[key] = answers
            self.conversations.move_to_end(key)
        while len(self.conversations) > CONVERSATIONS:
            self.conversations.popitem(last=False)
