"""Bounded in-memory store of finished Responses, for `previous_response_id` and GET / DELETE
/v1/responses/{id}.

Each entry keeps what the next turn needs, the conversation messages (input + output) of that response, and
the response object as its create call answered it. The output's text is held once: the output message's parts
and the object's output items are the same string objects (output.py), except where the conversation needs
another form (a custom tool's input wrapped as JSON arguments, reasoning's encrypted_content).

Two bounds, the least recently used response dropped first until both hold: at most `capacity` responses, and
at most `max_bytes` of the text they hold (held_bytes). The response just put is never dropped: one larger than
the byte bound is kept alone. A `previous_response_id` chain shares its Message objects (each turn's
conversation is the previous one's tuple plus the new messages), so each Message is counted once however many
entries hold it, and released when the last of them goes: counting it per entry would charge a chain of n
turns n times its history. Responses created with `store: false` never enter it.
"""
from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from typing import Iterator, NamedTuple

from aiohttp import web

from proxy.conversation import Message, TextPart, ThinkingPart, ToolCallPart, ToolResultPart

log = logging.getLogger("killick.proxy")
MB = 1 << 20


class StoredResponse(NamedTuple):
    messages: tuple[Message, ...]  # the conversation through this response's output, for previous_response_id
    response: dict  # the Response object, as the create call answered it
    own_bytes: int  # the object's text that no message of the entry holds (see ResponseStore)


class _Held(NamedTuple):
    """A Message some entries hold (the object, so its id() stays its own while counted)."""
    message: Message
    entries: int
    size: int


class ResponseStore:
    def __init__(self, capacity: int = 256, max_bytes: int = 512 * MB):
        if capacity < 1:
            raise ValueError(f"response store capacity must be >= 1, got {capacity}")
        if max_bytes < 1:
            raise ValueError(f"response store max_bytes must be >= 1, got {max_bytes}")
        self.capacity, self.max_bytes = capacity, max_bytes
        self.held_bytes = 0  # every held Message once, plus each entry's own_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._messages: dict[int, _Held] = {}  # by id(): two equal messages are two objects in memory

    def put(self, response_id: str, messages: tuple[Message, ...], response: dict) -> None:
        self.delete(response_id)
        new_text = {id(s) for m in messages if id(m) not in self._messages for s in _part_strings(m)}
        own = sum(sys.getsizeof(s) for s in _distinct_strings(response) if id(s) not in new_text)
        for m in messages:
            self._hold(m)
        self._items[response_id] = StoredResponse(messages, response, own)
        self.held_bytes += own
        while len(self._items) > 1 and (len(self._items) > self.capacity or self.held_bytes > self.max_bytes):
            self._release(self._items.popitem(last=False)[1])
        if self.held_bytes > self.max_bytes:
            log.warning("response %s holds %.1f MB, more than the store's bound (%.1f MB, --responses-store-mb): "
                        "it is kept alone", response_id, self.held_bytes / MB, self.max_bytes / MB)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        """-> whether the response was stored."""
        stored = self._items.pop(response_id, None)
        if stored is not None:
            self._release(stored)
        return stored is not None

    def __len__(self) -> int:
        return len(self._items)

    def _hold(self, message: Message) -> None:
        held = self._messages.get(id(message))
        if held is None:
            held = _Held(message, 0, message_bytes(message))
            self.held_bytes += held.size
        self._messages[id(message)] = held._replace(entries=held.entries + 1)

    def _release(self, stored: StoredResponse) -> None:
        self.held_bytes -= stored.own_bytes
        for m in stored.messages:
            held = self._messages[id(m)]
            if held.entries == 1:
                del self._messages[id(m)]
                self.held_bytes -= held.size
            else:
                self._messages[id(m)] = held._replace(entries=held.entries - 1)


def message_bytes(message: Message) -> int:
    """The memory of a message's text (sys.getsizeof: a str's real size, its width per character included)."""
    return sum(sys.getsizeof(s) for s in _part_strings(message))


def _part_strings(message: Message) -> Iterator[str]:
    for part in message.parts:
        if isinstance(part, (TextPart, ThinkingPart)):
            yield part.text
        elif isinstance(part, ToolCallPart):
            yield from (part.name, part.arguments, part.call_id)
        elif isinstance(part, ToolResultPart):
            yield from (part.content, part.call_id)


def _distinct_strings(value) -> Iterator[str]:
    """Every string object in a JSON-like value (keys left out: they are few and mostly interned), each once."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if id(item) not in seen:
                seen.add(id(item))
                yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


RESPONSES = web.AppKey("killick_responses", ResponseStore)  # one store per app (create_app)
