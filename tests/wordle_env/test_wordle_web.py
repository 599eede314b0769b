"""OpenEnv's web page on the Space's settings: ``/`` leads to it, it takes no uploads, and its
HTTP routes refuse hostile input with a 422, as the protocol routes do."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

MAX_REPLY_BYTES = 2_000

# (route, raw JSON body, a phrase the refusal must contain); openenv-core 0.3.0 answered the
# /web/step ones with a 500 and a traceback.
HOSTILE_WEB = [
    ("/web/step", '{"message": 1e400}', "Input should be a valid string"),
    ("/web/step", json.dumps({"message": "x" * 1_000}), "at most 256 characters"),
    ("/web/step", '{"action": []}', "body must be"),
    ("/web/step", "{}", "body must be"),
    ("/web/step", '{"action": {"tokens": [1, 2]}}', "Extra inputs are not permitted"),
    ("/web/step", "[1]", "Input should be a valid dictionary"),
    ("/web/reset", '{"seed": 1e400}', "seed"),
    ("/web/reset", json.dumps({"episode_id": "x" * 10_000}), "at most 255 characters"),
]


def _request(
    url: str, body: bytes, content_type: str = "application/json"
) -> tuple[int, bytes, str]:
    request = urllib.request.Request(url, body, {"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read(), response.url
    except urllib.error.HTTPError as refused:
        with refused:
            return refused.code, refused.read(), url


def _multipart(name: str, payload: bytes) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{name}"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    )
    body = head.encode() + payload + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def _new_log_lines(server: Any, before: list[str]) -> list[str]:
    return server.log.read_text().splitlines()[len(before) :]


def test_root_leads_to_the_page(web_server: Any) -> None:
    with urllib.request.urlopen(web_server.url + "/", timeout=30) as response:
        page = response.read().decode()
        assert (response.status, response.url) == (200, web_server.url + "/web/")
        assert response.headers["Content-Type"].startswith("text/html")
    assert "OpenEnv Agentic Environment: wordle_env" in page


@pytest.mark.parametrize("route", ["/web/gradio_api/upload", "/reset"])
def test_uploads_are_refused_and_nothing_is_kept(web_server: Any, route: str) -> None:
    before = web_server.log.read_text().splitlines()
    body, content_type = _multipart("payload.bin", b"\0" * 100_000)
    status, reply, _ = _request(web_server.url + route, body, content_type)
    assert status == 403, reply[:500]
    assert json.loads(reply) == {"detail": "this server takes no uploads"}
    gradio_dir = Path(web_server.settings["GRADIO_TEMP_DIR"])
    assert not gradio_dir.exists() or not any(p.is_file() for p in gradio_dir.rglob("*"))
    new_lines = _new_log_lines(web_server, before)
    assert len(new_lines) == 1 and f"POST {route} refused (403)" in new_lines[0], new_lines


@pytest.mark.parametrize(
    ("route", "body", "phrase"),
    HOSTILE_WEB,
    ids=[
        "step-message-1e400",
        "step-message-1k",
        "step-action-list",
        "step-empty",
        "step-tokens",
        "step-not-an-object",
        "reset-seed-1e400",
        "reset-episode-id-10k",
    ],
)
def test_hostile_web_input_is_a_422_with_one_log_line(
    web_server: Any, route: str, body: str, phrase: str
) -> None:
    before = web_server.log.read_text().splitlines()
    status, reply, _ = _request(web_server.url + route, body.encode())
    assert status == 422, reply[:500]
    assert len(reply) < MAX_REPLY_BYTES
    assert phrase in reply.decode()
    new_lines = _new_log_lines(web_server, before)
    assert len(new_lines) == 1, new_lines
    assert f"POST {route} refused (422): " in new_lines[0]
    assert "Traceback" not in web_server.log.read_text()


def test_oversized_web_step_is_refused_unread(web_server: Any) -> None:
    status, reply, _ = _request(web_server.url + "/web/step", b" " * 100_000)
    assert (status, json.loads(reply)) == (413, {"detail": "body missing or over 16384 bytes"})


def test_the_page_plays_a_game(web_server: Any) -> None:
    status, _, _ = _request(web_server.url + "/web/reset", b'{"word": "crane"}')
    assert status == 200
    status, reply, _ = _request(web_server.url + "/web/step", b'{"message": "[crane]"}')
    data = json.loads(reply)
    assert (status, data["reward"], data["done"]) == (200, 1.0, True)
    status, reply, _ = _request(web_server.url + "/web/step", b'{"action": {"message": "slate"}}')
    assert "The game is over" in json.loads(reply)["observation"]["info"]["error"]


def test_without_the_setting_there_is_no_page(server_url: str) -> None:
    for route in ("/", "/web/"):
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(server_url + route, timeout=10)
        assert missing.value.code == 404
        missing.value.close()


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) of wordle_env/server/Dockerfile, continuation lines joined."""
    text = (Path(__file__).resolve().parents[2] / "wordle_env/server/Dockerfile").read_text()
    lines = [line for line in text.replace("\\\n", " ").splitlines() if line.strip()]
    return [
        (word.upper(), rest.strip())
        for word, _, rest in (line.strip().partition(" ") for line in lines)
        if not word.startswith("#")
    ]


def test_the_space_image_serves_the_page_as_uid_1000() -> None:
    instructions = _dockerfile_instructions()
    env = dict(
        pair.split("=", 1) for kind, args in instructions if kind == "ENV" for pair in args.split()
    )
    assert (env["ENABLE_WEB_INTERFACE"], env["HOME"]) == ("true", "/home/user")
    assert ("USER", "1000") in instructions
    (health,) = [args for kind, args in instructions if kind == "HEALTHCHECK"]
    probe = json.loads(health.split(" CMD ", 1)[1])  # JSON form: no shell in the probe
    assert probe[:2] == ["python", "-c"] and "127.0.0.1:8000/health" in probe[2]
