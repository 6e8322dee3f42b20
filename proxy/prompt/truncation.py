"""Truncation (Responses `truncation: "auto"`): the conversation less its oldest droppable messages, so that its
prompt leaves the answer room in the context.

Never dropped: the leading system messages (the instructions), the last user message (the task) and the last
message (the input the model answers now). The others go oldest first, which drops the middle of the
conversation: a message together with the tool results that follow it, so that no result outlives its call.

Torch-free: rendering and counting come in as functions (proxy/preparing.py passes the app's).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Protocol, Sequence

from proxy.conversation import Conversation, Message

Span = tuple[int, int]  # messages[start:end]


class RenderedLike(Protocol):
    ids: Sequence[int]


def droppable(messages: Sequence[Message]) -> list[Span]:
    """The spans truncation may drop, oldest first: each a message and the tool results right after it."""
    head = 0
    while head < len(messages) and messages[head].role == "system":
        head += 1
    spans: list[list[int]] = []
    for i in range(head, len(messages)):
        if messages[i].role == "tool" and spans:
            spans[-1][1] = i + 1
        else:
            spans.append([i, i + 1])
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    kept = (last_user, len(messages) - 1)
    return [(a, b) for a, b in spans if not any(a <= k < b for k in kept)]


def without(conv: Conversation, spans: Sequence[Span]) -> Conversation:
    gone = {i for a, b in spans for i in range(a, b)}
    return replace(conv, messages=tuple(m for i, m in enumerate(conv.messages) if i not in gone))


def fit(conv: Conversation, limit: int, render: Callable[[Conversation], RenderedLike],
        cost: Callable[[Sequence[Message], int], int]) -> tuple[Conversation, RenderedLike]:
    """conv less as few of its oldest droppable spans as bring its prompt under `limit` tokens, and that prompt;
    all of them where even that is not enough (the caller checks what is left against the context).

    render(conv): the prompt; it may refuse one that cannot fit the context at all. cost(messages, most): the
    tokens of those messages' text, counted no further than `most`. A first guess keeps the newest spans whose
    text fits; text leaves out the template's own tokens, so where that prompt is over, the oldest kept spans
    whose text covers the excess go too, and a bisection between the two takes back what went too far."""
    spans = droppable(conv.messages)
    bare = without(conv, spans)
    prompts = {len(spans): render(bare)}  # by the number of oldest spans dropped
    costs: dict[int, int] = {}
    drop, room = len(spans), limit - 1 - len(prompts[len(spans)].ids)
    while drop > 0 and room >= 0:  # the newest spans that fit, by their text alone
        a, b = spans[drop - 1]
        costs[drop - 1] = cost(conv.messages[a:b], room + 1)
        if costs[drop - 1] > room:
            break
        room, drop = room - costs[drop - 1], drop - 1

    def fits(n: int) -> bool:
        if n not in prompts:
            prompts[n] = render(without(conv, spans[:n]))
        return len(prompts[n].ids) < limit

    over = None  # the most spans dropped that were seen to leave the prompt too long
    while drop < len(spans) and not fits(drop):
        over, excess = drop, len(prompts[drop].ids) - limit + 1
        while excess > 0 and drop < len(spans):
            excess, drop = excess - costs[drop], drop + 1
    while over is not None and drop - over > 1:
        mid = (over + drop) // 2
        over, drop = (over, mid) if fits(mid) else (mid, drop)
    return without(conv, spans[:drop]), prompts[drop]
