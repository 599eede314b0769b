"""An MCP server's reset observation reaches the model as the prompt's text: a single text field
alone (no `prompt:` key in front of the task), several fields one `name: value` line each."""

from __future__ import annotations

import pytest

from trainer.envs.mcp_tools import MCPSession


@pytest.mark.parametrize(
    ("observation", "text"),
    [
        ({"prompt": "Reach the target 30: add numbers."}, "\n\nReach the target 30: add numbers."),
        ({"task": "Add 2 and 3.", "metadata": {}, "hint": None}, "\n\nAdd 2 and 3."),
        ({"task": "Add 2 and 3.", "target": 5}, "\n\ntask: Add 2 and 3.\ntarget: 5"),
        ({"target": 30}, "\n\ntarget: 30"),
        ({"task": "", "metadata": {}}, ""),
    ],
)
def test_reset_observation_text(observation, text):
    assert MCPSession("http://127.0.0.1:9")._text(observation) == text
