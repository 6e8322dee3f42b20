"""A thinking budget (Anthropic thinking.budget_tokens) kept in upstream mode, where the proxy cannot write
`</think>` into the upstream's generation as the engine does (engine/api.py ThinkingBudget). Torch-free.

    meter = ThinkingMeter.of(tokenizer, params.thinking_budget)   # None: no budget
    if meter.add(item): ...                 # the answer thought `budget` tokens with nothing else written
    conv = past_thinking(conv, meter.text)  # the thinking as the assistant's turn, closed and left open

When the thinking reaches the budget the proxy closes that answer (the upstream stops generating) and asks the same
replica to continue the assistant's turn after the thinking, closed by the chat template (`continue_final_message`):
the model goes on with its answer, as if it had written `</think>` there itself.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from proxy.conversation import Conversation, Message, ThinkingPart
from proxy.prompt.output_parser import OutputEvent, ThinkingDelta


class ThinkingMeter:
    """An answer's thinking counted in the proxy's tokens against a budget, while nothing else was written."""

    def __init__(self, tokenizer, budget: int):
        self.tokenizer, self.budget = tokenizer, budget
        self.pieces: list[str] = []
        self.tokens = 0  # the thinking's tokens: an estimate (each piece apart) until it nears the budget
        self.other = False  # text or a tool call came: the thinking has ended
        self.reached = False

    @classmethod
    def of(cls, tokenizer, budget: Optional[int]) -> Optional["ThinkingMeter"]:
        return None if budget is None else cls(tokenizer, budget)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, item: OutputEvent) -> bool:
        """Whether, with `item`, the thinking has reached the budget (the answer should be cut there)."""
        if self.other or self.reached:
            return False
        if not isinstance(item, ThinkingDelta):
            self.other = True
            return False
        self.pieces.append(item.text)
        self.tokens += len(self.tokenizer.encode(item.text))
        if self.tokens >= self.budget:  # pieces encoded apart can count a few more than the whole: count it
            self.tokens = len(self.tokenizer.encode(self.text))
            self.reached = self.tokens >= self.budget
        return self.reached


def past_thinking(conv: Conversation, thinking: str) -> Conversation:
    """The conversation with `thinking` as the assistant's last turn, left open after the closed thinking, so that
    the model writes its answer next (thinking off: llama.cpp refuses a continued turn with it on)."""
    turn = Message("assistant", (ThinkingPart(thinking),))
    return replace(conv, messages=conv.messages + (turn,), continue_last=True, enable_thinking=False)
