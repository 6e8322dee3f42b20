"""Bounded in-memory store of finished Responses, for `previous_response_id`.

Only what the next turn needs is kept: the conversation messages (input + output) of that response.
Responses created with `store: false` never enter it.
"""
from __future__ import annotations

from collections import OrderedDict

from aiohttp import web

from proxy.conversation import Message


class ResponseStore:
    def __init__(self, capacity: int = 256):
        if capacity < 1:
            raise ValueError(f"response store capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[Message, ...]] = OrderedDict()

    def put(self, response_id: str, messages: tuple[Message, ...]) -> None:
        self._items[response_id] = messages
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[Message, ...] | None:
        messages = self._items.get(response_id)
        if messages is not None:
            self._items.move_to_end(response_id)
        return messages

    def __len__(self) -> int:
        return len(self._items)


RESPONSES = web.AppKey("killick_responses", ResponseStore)  # one store per app (create_app)
