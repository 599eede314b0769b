"""A fake `hf` (huggingface_hub 2.4 CLI) for launch.py's tests: records each call, keeps a tiny
Hub in a JSON file and answers like the real CLI (`--format json` shapes, `Error: ...` lines on
stderr, exit status 1). Installed on PATH as `hf` by the `hub` fixture.

Environment: FAKE_HF_STATE (the Hub, JSON), FAKE_HF_LOG (one JSON line per call).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

VALUE_OPTIONS = {
    "--format",
    "--type",
    "--repo-type",
    "--sdk",
    "--flavor",
    "-s",
    "--secrets",
    "-e",
    "--env",
    "--commit-message",
    "--delete",
    "--hardware",
    "-n",
    "--tail",
    "--timeout",
    "--sleep-time",
    "--secrets-file",
}
# `hf spaces hardware --format json` rows (the CLI's own columns), a subset of the Hub's list.
HARDWARE = [
    ("cpu-basic", "CPU basic", "2 vCPU", "16 GB", None, "free", "free"),
    ("cpu-upgrade", "CPU upgrade", "8 vCPU", "32 GB", None, "$0.0005", "$0.03"),
    ("t4-small", "Nvidia T4 - small", "4 vCPU", "15 GB", "1x T4 (16 GB)", "$0.0067", "$0.40"),
    ("l4x1", "1x Nvidia L4", "8 vCPU", "30 GB", "1x L4 (24 GB)", "$0.0133", "$0.80"),
    ("a10g-small", "Nvidia A10G - small", "4 vCPU", "15 GB", "1x A10G (24 GB)", "$0.0167", "$1.00"),
    (
        "a100-large",
        "Nvidia A100 - large",
        "12 vCPU",
        "142 GB",
        "1x A100 (80 GB)",
        "$0.0417",
        "$2.50",
    ),
]


class Lines(list):
    """A text answer (`hf spaces logs`): printed one line each, not as JSON."""


HTTP_402 = (
    "Error: Client error '402 Payment Required' for url 'https://huggingface.co/api/{what}' "
    "(Request ID: Root=1-6789abcd-0123456789abcdef)\n"
    "For more information check: https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/402\n\n"
    "You must add a payment method to your account to use this hardware.\n"
)
HTTP_409 = (
    "Error: Client error '409 Conflict' for url 'https://huggingface.co/api/repos/create' "
    "(Request ID: Root=1-6789abcd-0123456789abcdef)\n\nYou already created this space repo\n"
)
HTTP_403 = (
    "Error: \n\n403 Forbidden: You don't have the rights to create a space under the namespace "
    '"{ns}".\nCannot access content at: https://huggingface.co/api/repos/create.\n'
    "Make sure your token has the correct permissions.\n"
)
# What huggingface_hub 2.4's CLI prints when the Hub cannot be reached (its last lines, as
# captured from `hf spaces hardware --format json` on a machine without DNS for the Hub).
OFFLINE = (
    "Traceback (most recent call last):\n"
    '  File ".venv/lib/python3.11/site-packages/httpx2/_transports/default.py", line 112, in '
    "map_httpcore_exceptions\n"
    "    raise mapped_exc(message) from exc\n"
    "httpx2.ConnectError: [Errno -2] Name or service not known\n"
)


class Fail(Exception):
    def __init__(self, stderr: str, code: int = 1):
        super().__init__(stderr)
        self.stderr = stderr
        self.code = code


def parse(argv: list[str]) -> tuple[list[str], dict[str, list[str]], set[str]]:
    positional, options, flags = [], {}, set()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in VALUE_OPTIONS:
            options.setdefault(arg, []).append(argv[i + 1])
            i += 2
        elif arg.startswith("-"):
            flags.add(arg)
            i += 1
        else:
            positional.append(arg)
            i += 1
    return positional, options, flags


def opt(options: dict[str, list[str]], *names: str) -> str | None:
    for name in names:
        if name in options:
            return options[name][-1]
    return None


def main() -> int:
    state_path = Path(os.environ["FAKE_HF_STATE"])
    state = json.loads(state_path.read_text())
    argv = sys.argv[1:]
    with open(os.environ["FAKE_HF_LOG"], "a") as log:
        log.write(json.dumps({"argv": argv}) + "\n")
    try:
        result = dispatch(state, argv)
    except Fail as exc:
        sys.stderr.write(exc.stderr)
        state_path.write_text(json.dumps(state, indent=1))
        return exc.code
    state_path.write_text(json.dumps(state, indent=1))
    if isinstance(result, Lines):
        print("\n".join(result))
    elif result is not None:
        print(json.dumps(result))
    return 0


def dispatch(state: dict, argv: list[str]):
    pos, options, flags = parse(argv)
    fmt = opt(options, "--format")
    if state.get("version_mode") == "old" and fmt:
        raise Fail(
            "Usage: hf version [OPTIONS]\nTry 'hf version -h' for help.\n\n"
            "Error: No such option: --format\n",
            2,
        )
    cmd = tuple(pos[:2])
    if pos[:1] == ["version"]:
        return {"version": state.get("version", "2.4.0")}
    if state.get("offline"):  # the CLI itself runs; every call to the Hub fails
        raise Fail(OFFLINE)
    if cmd == ("auth", "whoami"):
        if not state.get("user"):
            raise Fail("Error: Not logged in. Run `hf auth login` first.\n")
        return {
            "user": state["user"],
            "orgs": ",".join(state.get("orgs", [])) or None,
            "endpoint": None,
        }
    namespaces = set(state.get("writable") or {state.get("user"), *state.get("orgs", [])})
    spaces, buckets = state.setdefault("spaces", {}), state.setdefault("buckets", {})
    if cmd == ("buckets", "create"):
        bucket_id = pos[2]
        if bucket_id.split("/")[0] not in namespaces:
            raise Fail(HTTP_403.format(ns=bucket_id.split("/")[0]))
        if bucket_id in buckets and "--exist-ok" not in flags:
            raise Fail(HTTP_409)
        buckets.setdefault(bucket_id, {"private": "--private" in flags})
        return {
            "uri": f"hf://buckets/{bucket_id}",
            "url": f"https://huggingface.co/buckets/{bucket_id}",
        }
    if cmd == ("buckets", "info"):
        if pos[2] not in buckets:
            raise Fail(f"Error: Bucket '{pos[2]}' not found.\n")
        return {
            "id": pos[2],
            "private": buckets[pos[2]]["private"],
            "created_at": "2026-01-02 03:04:05+00:00",
            "size": 0,
            "total_files": 0,
        }
    if cmd == ("buckets", "settings"):
        if pos[2] not in buckets:
            raise Fail(f"Error: Bucket '{pos[2]}' not found.\n")
        if ("--private" in flags) == ("--public" in flags):
            raise Fail("Error: Invalid value: Specify exactly one of --private or --public.\n", 2)
        buckets[pos[2]]["private"] = "--private" in flags
        return {"bucket_id": pos[2], "private": buckets[pos[2]]["private"]}
    if cmd == ("buckets", "delete"):
        if pos[2] not in buckets and "--missing-ok" not in flags:
            raise Fail(f"Error: Bucket '{pos[2]}' not found.\n")
        buckets.pop(pos[2], None)
        return {"bucket_id": pos[2]}
    if cmd == ("repos", "create"):
        repo_id = pos[2]
        if repo_id.split("/")[0] not in namespaces:
            raise Fail(HTTP_403.format(ns=repo_id.split("/")[0]))
        if repo_id in spaces:
            if "--exist-ok" not in flags:
                raise Fail(HTTP_409)
            return created(repo_id)  # settings are ignored, like the real Hub
        check_payment(state, opt(options, "--flavor"), "repos/create")
        spaces[repo_id] = new_space(options, flags, sdk=opt(options, "--sdk"))
        apply_settings(spaces[repo_id], options)
        return created(repo_id)
    if cmd == ("repos", "duplicate"):
        source, repo_id = pos[2], pos[3]
        if source not in spaces:
            raise Fail(
                f"Error: Space '{source}' not found.\nIf the repo is private, make sure "
                "you are authenticated and your token has the required permissions.\n"
            )
        if repo_id in spaces and "--exist-ok" not in flags:
            raise Fail(HTTP_409)
        check_payment(state, opt(options, "--flavor"), f"spaces/{source}/duplicate")
        space = new_space(options, flags, sdk=spaces[source]["sdk"])
        space.update(tags=list(spaces[source]["tags"]), sha=spaces[source]["sha"], stage="RUNNING")
        spaces[repo_id] = space
        apply_settings(space, options)
        return {
            "from_id": source,
            "to_id": repo_id,
            "url": f"https://huggingface.co/spaces/{repo_id}",
        }
    if cmd == ("repos", "delete"):
        if pos[2] not in spaces and "--missing-ok" not in flags:
            raise Fail(f"Error: Space '{pos[2]}' not found.\n")
        spaces.pop(pos[2], None)
        return {"repo_id": pos[2]}
    if cmd == ("repos", "settings"):
        space = existing(spaces, pos[2])
        if "--private" in flags or "--public" in flags:
            space["private"] = "--private" in flags
        return {"repo_id": pos[2]}
    if pos[:1] == ["upload"]:
        repo_id, folder = pos[1], Path(pos[2])
        if repo_id not in spaces:  # the real CLI creates a (gradio) Space here
            spaces[repo_id] = new_space({}, set(), sdk="gradio")
        upload(state, spaces[repo_id], repo_id, folder)
        return {"url": f"https://huggingface.co/spaces/{repo_id}/tree/main/"}
    if cmd == ("spaces", "info"):
        repo_id = pos[2]
        if repo_id not in spaces:
            raise Fail(f"Error: Space '{repo_id}' not found.\n")
        return info(spaces[repo_id], repo_id)
    if cmd == ("spaces", "hardware"):
        rows = state.get("hardware", HARDWARE)
        keys = ("name", "pretty name", "cpu", "ram", "accelerator", "cost/min", "cost/hour")
        return [dict(zip(keys, row, strict=True)) for row in rows]
    if cmd == ("spaces", "settings"):
        space = existing(spaces, pos[2])
        check_payment(state, opt(options, "--hardware"), f"spaces/{pos[2]}/hardware")
        space["hardware"] = opt(options, "--hardware") or space["hardware"]
        if opt(options, "--sleep-time"):
            space["sleep_time"] = int(opt(options, "--sleep-time"))
        return {"space_id": pos[2], "hardware": space["hardware"], "sleep_time": None}
    if cmd == ("spaces", "secrets") and pos[2] == "add":
        space = existing(spaces, pos[3])
        values = all_secrets(options)
        space["secrets"].update(values)
        return {"space_id": pos[3], "keys": list(values)}
    if cmd == ("spaces", "variables") and pos[2] == "add":
        space = existing(spaces, pos[3])
        space["variables"].update(dict(v.split("=", 1) for v in options.get("-e", [])))
        return {"space_id": pos[3], "keys": [v.split("=", 1)[0] for v in options.get("-e", [])]}
    if cmd == ("spaces", "logs"):
        space = existing(spaces, pos[2])
        lines = space.get("build_logs" if "--build" in flags else "logs", [])
        return Lines(lines[-int(opt(options, "-n") or len(lines) or 1) :])
    if cmd == ("spaces", "restart"):
        existing(spaces, pos[2])["stage"] = "RUNNING"
        return {"space_id": pos[2], "stage": "RUNNING", "factory_reboot": False}
    raise Fail(f"Error: the fake hf does not know `hf {' '.join(argv)}`\n", 2)


def existing(spaces: dict, repo_id: str) -> dict:
    if repo_id not in spaces:
        raise Fail(f"Error: Space '{repo_id}' not found.\n")
    return spaces[repo_id]


def check_payment(state: dict, flavor: str | None, what: str) -> None:
    if flavor and flavor in state.get("paid_flavors", []):
        raise Fail(HTTP_402.format(what=what))


def created(repo_id: str) -> dict:
    return {"repo_id": repo_id, "url": f"https://huggingface.co/spaces/{repo_id}"}


def new_space(options: dict, flags: set, *, sdk: str | None) -> dict:
    return {
        "sdk": sdk,
        "private": "--private" in flags,
        "hardware": "cpu-basic",
        "secrets": {},
        "variables": {},
        "tags": [],
        "sha": "0" * 40,
        "stage": "NO_APP_FILE",
        "stages": [],
    }


def apply_settings(space: dict, options: dict) -> None:
    space["hardware"] = opt(options, "--flavor") or space["hardware"]
    if opt(options, "--sleep-time"):
        space["sleep_time"] = int(opt(options, "--sleep-time"))
    space["secrets"].update(all_secrets(options))
    space["variables"].update(dict(v.split("=", 1) for v in options.get("-e", [])))


def all_secrets(options: dict) -> dict[str, str]:
    """`--secrets-file -` (KEY=VALUE lines on stdin), then `-s KEY`, like the real CLI."""
    values: dict[str, str] = {}
    for source in options.get("--secrets-file", []):
        if source != "-":
            raise Fail("Error: the fake hf reads --secrets-file only from stdin (-)\n", 2)
        for line in sys.stdin.read().splitlines():
            key, sep, value = line.partition("=")
            if not sep or not key or not value:
                raise Fail(f"Error: bad secrets line {key!r} on stdin\n")
            values[key] = value
    return {**values, **secret_values(options.get("-s", []))}


def secret_values(keys: list[str]) -> dict[str, str]:
    """`-s KEY` reads the value from the environment (HF_TOKEN: the stored login)."""
    values = {}
    for key in keys:
        if "=" in key:
            raise Fail(f"Error: the fake hf refuses inline secret values ({key.split('=')[0]})\n")
        value = os.environ.get(key) or ("hf_stored_token" if key == "HF_TOKEN" else None)
        if not value:
            raise Fail(f"Error: secret {key} has no value in the environment\n")
        values[key] = value
    return values


def upload(state: dict, space: dict, repo_id: str, folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in files)).hexdigest()
    space["files"] = [p.relative_to(folder).as_posix() for p in files]
    readme = (folder / "README.md").read_text() if (folder / "README.md").exists() else ""
    front = readme.split("---")[1] if readme.startswith("---") else ""
    space["tags"] = [x.strip()[2:] for x in front.splitlines() if x.strip().startswith("- ")]
    space["build_logs"] = state.get("build_logs", {}).get(repo_id, [])
    if digest != space["sha"]:
        space["sha"] = digest
        space["stages"] = list(state.get("stages_after_upload", {}).get(repo_id, ["RUNNING"]))


def info(space: dict, repo_id: str) -> dict:
    if space.get("stages"):
        space["stage"] = space["stages"].pop(0)
    sub = repo_id.lower().replace("/", "-")
    return {
        "id": repo_id,
        "author": repo_id.split("/")[0],
        "sha": space["sha"],
        "private": space["private"],
        "sdk": space["sdk"],
        "host": f"https://{sub}.hf.space",
        "subdomain": sub,
        "card_data": {"tags": space["tags"]},
        "tags": space["tags"],
        "runtime": {
            "stage": space["stage"],
            "hardware": space["hardware"],
            "requested_hardware": space["hardware"],
            "raw": {"stage": space["stage"], "sha": space["sha"]},
        },
    }


if __name__ == "__main__":
    sys.exit(main())
