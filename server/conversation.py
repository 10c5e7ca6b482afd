"""A stored conversation's next prompt, as the previous turn's exact token ids and then only the new
tokens.

Re-tokenizing a conversation's text need not give back the ids the model generated (a byte-level
model's answer that is not valid UTF-8 never does), and then the cached prefix ends where the ids
first differ. A stored response keeps its prompt ids and output ids (server/response_store.py); the
next prompt is those ids, then the chat template's closing of the answer, then the new messages as
the template renders them:

    T1 = render(history, generation prompt)      what the previous prompt ids stand for
    T2 = render(history + answer)                T1, the answer, the template's closing of it
    T3 = render(history + answer + new input, generation prompt)

Where T1 is a prefix of T2 and T2 of T3 (the template renders a conversation turn by turn: checked
on the full render every time), the prompt is prompt_ids + output_ids + tokens(closing) + tokens(T3
after T2); when the answer is not its plain text (tool calls, which the template writes its own way)
its part is tokens(T2 after T1). Otherwise (another system prompt or other tools, a template that
rewrites earlier turns) it is the full render's tokens, as chat completions would run.
"""

from __future__ import annotations

from typing import Any

from server.detokenizer import special_ids
from server.response_store import StoredResponse
from server.tools import template_messages


def system_messages(instructions: str | None) -> list[dict[str, Any]]:
    return [] if instructions is None else [{"role": "system", "content": instructions}]


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    generation: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    return tokenizer.apply_chat_template(
        template_messages(messages),
        tools=tools,
        add_generation_prompt=generation,
        tokenize=False,
        **(template_kwargs or {}),
    )


def first_prompt(
    tokenizer: Any,
    instructions: str | None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """A conversation's first prompt ids: rendered by the same code as the T1 that later turns check
    against."""
    return tokenizer.encode(
        render(tokenizer, system_messages(instructions) + messages, tools, True, template_kwargs),
        add_special_tokens=False,
    )


def continued_prompt(
    tokenizer: Any,
    prev: StoredResponse,
    instructions: str | None,
    new: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], bool]:
    """The prompt ids of the turn after prev with the new messages, and whether prev's ids were kept
    (False: the full render's tokens). Raises what the template raises on messages it refuses."""
    before = system_messages(prev.instructions) + prev.history
    answered = before + [prev.assistant]
    after = system_messages(instructions) + prev.history + [prev.assistant] + new
    full = render(tokenizer, after, tools, True, template_kwargs)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    if instructions != prev.instructions or tools != prev.tools:
        return encode(full), False
    t1 = render(tokenizer, before, tools, True, template_kwargs)
    t2 = render(tokenizer, answered, tools, False, template_kwargs)
    if not (t2.startswith(t1) and full.startswith(t2)):
        return encode(full), False
    tail = t2[len(t1) :]
    content = prev.assistant.get("content") or ""
    if prev.exact and not prev.assistant.get("tool_calls") and tail.startswith(content):
        answer = list(prev.output_ids)
        closing = tail[len(content) :]
        if answer and answer[-1] in special_ids(tokenizer):
            # Its stop token: kept where the template closes the answer with it, else dropped (its
            # KV was never computed: the last sampled token is not run through the model).
            stop = tokenizer.decode(answer[-1:], skip_special_tokens=False)
            if stop and closing.startswith(stop):
                closing = closing[len(stop) :]
            else:
                answer.pop()
        middle = answer + encode(closing)
    else:
        middle = encode(tail)
    return prev.prompt_ids + middle + encode(full[len(t2) :]), True
