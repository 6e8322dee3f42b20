"""Reply sources: which answer replaces sampling, in which order, and a bad forced response is a 400."""
from types import SimpleNamespace

import pytest

from proxy.conversation import Conversation, Message, TextPart
from proxy.errors import ApiError
from proxy.policy.planner import Plan
from proxy.replay.scripted import FORCE_RESPONSE_HEADER
from proxy.replay.sources import OUTPUT_HEADER, FirstReply, ForcedResponses, OutputHeader
from proxy_fakes import CharTokenizer, ChatMLRenderer

CONV = Conversation((Message("user", (TextPart("hi"),)),), enable_thinking=False)


def ask(source, headers):
    tok = CharTokenizer()
    ctx = SimpleNamespace(tokenizer=tok, renderer=ChatMLRenderer(tok))
    prompt = ctx.renderer.render(CONV).text
    return source.reply_ids(ctx, CONV, prompt, headers, Plan())


def test_output_header_emits_its_text_and_nothing_without_it():
    assert ask(OutputHeader(), {OUTPUT_HEADER: "a\\nb"}) == CharTokenizer().encode("a\nb")
    assert ask(OutputHeader(), {}) is None


def test_first_reply_takes_the_first_source_that_answers():
    class Fixed:
        def __init__(self, ids):
            self.ids = ids

        def reply_ids(self, *args):
            return self.ids

    assert ask(FirstReply(Fixed(None), Fixed([5]), Fixed([6])), {}) == [5]
    assert ask(FirstReply(Fixed(None)), {}) is None


def test_a_forced_response_that_is_not_base64_json_is_a_400():
    assert ask(ForcedResponses(), {}) is None
    with pytest.raises(ApiError) as err:
        ask(ForcedResponses(), {FORCE_RESPONSE_HEADER: "not base64 json"})
    assert err.value.status == 400 and FORCE_RESPONSE_HEADER in err.value.message
