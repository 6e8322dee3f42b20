"""What each API's schema accepts, refuses and warns about, without a server."""
import logging

from proxy.apis.responses.schema import ResponsesRequest
from proxy.apis.responses.tools import offered_tools


def test_unserved_tool_types_are_warned_about_once(caplog):
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [
        {"type": "shell_of_this_test"}, {"type": "function", "name": "ls", "parameters": {"type": "object"}}]})
    with caplog.at_level(logging.WARNING, logger="killick.proxy"):
        for _ in range(3):  # Codex sends the same tools with every request
            assert list(offered_tools(req.tools)) == ["ls"]
    assert caplog.text.count("'shell_of_this_test' is not served") == 1
