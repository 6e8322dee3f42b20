"""Bounded in-memory store of finished Responses, for `previous_response_id` and GET / DELETE
/v1/responses/{id}.

Each entry keeps what the next turn needs, the conversation messages (input + output) of that response, and
the response object as its create call answered it. At most `capacity` responses are kept, the least recently
used dropped first; each costs about twice its output (the messages and the object both hold it) plus its
input messages. Responses created with `store: false` never enter it.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from aiohttp import web

from proxy.conversation import Message


class StoredResponse(NamedTuple):
    messages: tuple[Message, ...]  # the conversation through this response's output, for previous_response_id
    response: dict  # the Response object, as the create call answered it


class ResponseStore:
    def __init__(self, capacity: int = 256):
        if capacity < 1:
            raise ValueError(f"response store capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, messages: tuple[Message, ...], response: dict) -> None:
        self._items[response_id] = StoredResponse(messages, response)
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        """-> whether the response was stored."""
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)


RESPONSES = web.AppKey("killick_responses", ResponseStore)  # one store per app (create_app)
