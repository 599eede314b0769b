"""`python launch.py --model ...` against a fake `hf`: the exact call sequences of a fresh launch,
a re-run, `--from-template` and `--teardown`, what ends up on the (fake) Hub, and the trainer
command. The `hub` fixture also parses every recorded call with the real CLI's parser."""

from __future__ import annotations

import json
import stat
import sys

MODEL = "Qwen/Qwen3-1.7B"
BUCKET_ID = "alice/deltasync-weights"
BUCKET = f"hf://buckets/{BUCKET_ID}"
J = ["--format", "json"]


def replicas_variable(count: int = 1) -> str:
    """What the dashboard Space is told to watch: every vLLM Space's URL."""
    hosts = [f"https://alice-deltasync-vllm-{i}.hf.space" for i in range(count)]
    return "DELTASYNC_REPLICAS=" + ",".join(hosts)


def head() -> list[list[str]]:
    return [["version", *J], ["auth", "whoami", *J]]


def deploy_head(bucket: str = "new") -> list[list[str]]:
    """The calls before any Space: login, the hardware list, then the bucket (`new`: created,
    `same`: exists with the visibility asked for)."""
    calls = [*head(), ["spaces", "hardware", *J], ["buckets", "info", BUCKET_ID, *J]]
    if bucket == "new":
        calls.append(["buckets", "create", BUCKET_ID, "--exist-ok", *J])
    return calls


def infos(*roles: str) -> list[list[str]]:
    return [["spaces", "info", f"alice/deltasync-{r}", *J] for r in roles]


def create(hub, role: str) -> list[list[str]]:
    repo = f"alice/deltasync-{role}"
    kind = role.split("-")[0]
    settings = {
        "vllm": [
            "--flavor",
            "a10g-small",
            "--sleep-time",
            "3600",
            "-s",
            "HF_TOKEN",
            "-s",
            "DELTASYNC_API_KEY",
            "-e",
            f"MODEL={MODEL}",
            "-e",
            f"BUCKET={BUCKET}",
            "-e",
            "VLLM_ARGS=--max-model-len 4096 --gpu-memory-utilization 0.85",
        ],
        "wordle": ["--flavor", "cpu-basic", "-s", "ENV_API_KEY"],
        "dashboard": [
            "--flavor",
            "cpu-basic",
            "-s",
            "HF_TOKEN",
            "-e",
            f"DELTASYNC_BUCKET={BUCKET}",
            "-e",
            replicas_variable(),
        ],
    }[kind]
    sdk = "gradio" if kind == "dashboard" else "docker"
    return [["repos", "create", repo, "--sdk", sdk, "--type", "space", *settings, *J]]


def upload(hub, role: str, message: str) -> list[list[str]]:
    repo, kind = f"alice/deltasync-{role}", role.split("-")[0]
    context = str(hub.workdir.resolve() / "stage" / kind)
    return [
        [
            "upload",
            repo,
            context,
            ".",
            "--type",
            "space",
            "--commit-message",
            message,
            "--delete",
            "*",
            *J,
        ]
    ]


def reapply(role: str) -> list[list[str]]:
    repo = f"alice/deltasync-{role}"
    kind = role.split("-")[0]
    flavor = "a10g-small" if kind == "vllm" else "cpu-basic"
    sleep = ["--sleep-time", "3600"] if kind == "vllm" else []  # a GPU: a10g-small
    calls = [["spaces", "settings", repo, "--hardware", flavor, *sleep, *J]]
    if kind == "vllm":
        calls += [
            ["spaces", "secrets", "add", repo, "-s", "HF_TOKEN", "-s", "DELTASYNC_API_KEY", *J],
            [
                "spaces",
                "variables",
                "add",
                repo,
                "-e",
                f"MODEL={MODEL}",
                "-e",
                f"BUCKET={BUCKET}",
                "-e",
                "VLLM_ARGS=--max-model-len 4096 --gpu-memory-utilization 0.85",
                *J,
            ],
        ]
    if kind == "wordle":
        calls += [["spaces", "secrets", "add", repo, "-s", "ENV_API_KEY", *J]]
    if kind == "dashboard":
        calls += [
            ["spaces", "secrets", "add", repo, "-s", "HF_TOKEN", *J],
            [
                "spaces",
                "variables",
                "add",
                repo,
                "-e",
                f"DELTASYNC_BUCKET={BUCKET}",
                "-e",
                replicas_variable(),
                *J,
            ],
        ]
    return calls


def commit_message(hub) -> str:
    return next(c for c in hub.calls() if c[0] == "upload")[7]


def test_fresh_launch_sequence(hub):
    result = hub.launch("--model", MODEL, "--no-train")
    assert result.code == 0, result.err
    message = commit_message(hub)
    assert message.startswith("launch.py: deploy")
    roles = ("vllm-0", "wordle", "dashboard")
    expected = [
        *deploy_head(),
        *infos(*roles),
        *[call for r in roles for call in (*create(hub, r), *upload(hub, r, message))],
        *infos(*roles),  # wait: each is RUNNING at the first poll
    ]
    assert hub.calls() == expected
    state = hub.state
    vllm = state["spaces"]["alice/deltasync-vllm-0"]
    assert vllm["hardware"] == "a10g-small" and vllm["sdk"] == "docker"
    assert vllm["variables"]["MODEL"] == MODEL and vllm["variables"]["BUCKET"] == BUCKET
    key_file = hub.workdir / "api-key-alice-deltasync"
    key = key_file.read_text().strip()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert vllm["secrets"]["DELTASYNC_API_KEY"] == key  # read from the env, never from argv
    # the public Wordle Space plays only for the holder of the same key
    assert hub.state["spaces"]["alice/deltasync-wordle"]["secrets"]["ENV_API_KEY"] == key
    assert all(key not in " ".join(c) for c in hub.calls())
    assert (
        "deltasync" in vllm["tags"]
        and "deltasync" in state["spaces"]["alice/deltasync-wordle"]["tags"]
    )
    assert {
        "Dockerfile",
        "README.md",
        "entrypoint.sh",
        "pyproject.toml",
        "BUILD_INFO.json",
        "deltasync/__init__.py",
    } <= set(vllm["files"])
    wordle = state["spaces"]["alice/deltasync-wordle"]  # wordle_env/, its Dockerfile at the root
    assert {
        "Dockerfile",
        "README.md",
        "pyproject.toml",
        "openenv.yaml",
        "BUILD_INFO.json",
        "server/app.py",
    } <= set(wordle["files"])
    assert "server/Dockerfile" not in wordle["files"] and wordle["sdk"] == "docker"
    dashboard = state["spaces"]["alice/deltasync-dashboard"]
    assert dashboard["sdk"] == "gradio" and "deltasync" in dashboard["tags"]
    assert {"app.py", "requirements.txt", "deltasync_dashboard/app.py"} <= set(dashboard["files"])
    assert "Dockerfile" not in dashboard["files"]
    assert "https://alice-deltasync-vllm-0.hf.space" in result.out
    assert "--vllm-server-url https://alice-deltasync-vllm-0.hf.space" in result.out
    assert "--env wordle --env-url https://alice-deltasync-wordle.hf.space" in result.out
    assert f"DELTASYNC_API_KEY=$(cat {key_file})" in result.out


def test_rerun_reapplies_settings_and_creates_nothing(hub):
    assert hub.launch("--model", MODEL, "--no-train").code == 0
    message = commit_message(hub)
    state = hub.state
    vllm = state["spaces"]["alice/deltasync-vllm-0"]
    vllm["hardware"] = "cpu-basic"  # changed by hand in the Space settings
    vllm["variables"]["MODEL"] = "other/model"
    hub.state = state
    hub.clear_calls()

    result = hub.launch("--model", MODEL, "--no-train")
    assert result.code == 0, result.err
    roles = ("vllm-0", "wordle", "dashboard")
    assert hub.calls() == [
        *deploy_head("same"),
        *infos(*roles),
        *[call for r in roles for call in (*reapply(r), *upload(hub, r, message))],
        *infos(*roles),
    ]
    vllm = hub.state["spaces"]["alice/deltasync-vllm-0"]
    assert vllm["hardware"] == "a10g-small" and vllm["variables"]["MODEL"] == MODEL
    assert "updating alice/deltasync-vllm-0" in result.out


def test_a_rerun_with_more_replicas_adds_spaces_the_dashboard_watches(hub):
    """`--replicas 2` on a re-run creates only the new vLLM Space (which follows the bucket by
    itself) and tells the dashboard Space both replicas' URLs."""
    assert hub.launch("--model", MODEL, "--no-train").code == 0
    hub.clear_calls()
    result = hub.launch("--model", MODEL, "--no-train", "--replicas", "2")
    assert result.code == 0, result.err
    calls = hub.calls()
    assert [c[2] for c in calls if c[:2] == ["repos", "create"]] == ["alice/deltasync-vllm-1"]
    dashboard = hub.state["spaces"]["alice/deltasync-dashboard"]["variables"]
    assert "DELTASYNC_REPLICAS=" + dashboard["DELTASYNC_REPLICAS"] == replicas_variable(2)
    replica = hub.state["spaces"]["alice/deltasync-vllm-1"]["variables"]
    assert replica["BUCKET"] == BUCKET and replica["MODEL"] == MODEL


def test_private_and_more_replicas(hub):
    result = hub.launch(
        "--model",
        MODEL,
        "--no-train",
        "--private",
        "--replicas",
        "2",
        "--env",
        "https://someone-chess.hf.space",
    )
    assert result.code == 0, result.err
    calls = hub.calls()
    assert ["buckets", "create", BUCKET_ID, "--private", "--exist-ok", *J] in calls
    created = {c[2]: c for c in calls if c[:2] == ["repos", "create"]}
    assert set(created) == {
        "alice/deltasync-vllm-0",
        "alice/deltasync-vllm-1",
        "alice/deltasync-dashboard",
    }  # no Wordle Space: the environment is someone's OpenEnv Space
    assert "--private" in created["alice/deltasync-dashboard"]
    assert "--private" not in created["alice/deltasync-vllm-0"]  # token-guarded, see plan.py
    assert "--env openenv --env-url https://someone-chess.hf.space" in result.out
    assert (
        "--vllm-server-url https://alice-deltasync-vllm-0.hf.space "
        "--vllm-server-url https://alice-deltasync-vllm-1.hf.space"
    ) in result.out


def _publish_templates(hub, owner: str = "bob") -> None:
    state = hub.state
    for role in ("vllm-0", "wordle", "dashboard"):
        state["spaces"][f"{owner}/deltasync-{role}"] = {
            "sdk": "gradio" if role == "dashboard" else "docker",
            "private": False,
            "hardware": "cpu-basic",
            "secrets": {},
            "variables": {},
            "tags": ["deltasync"],
            "sha": "f" * 40,
            "stage": "RUNNING",
            "stages": [],
        }
    hub.state = state


def test_from_template_duplicates_instead_of_uploading(hub):
    _publish_templates(hub)
    result = hub.launch("--model", MODEL, "--no-train", "--from-template", "bob", "--replicas", "2")
    assert result.code == 0, result.err
    vllm_settings = [
        "--type",
        "space",
        "--flavor",
        "a10g-small",
        "--sleep-time",
        "3600",
        "-s",
        "HF_TOKEN",
        "-s",
        "DELTASYNC_API_KEY",
        "-e",
        f"MODEL={MODEL}",
        "-e",
        f"BUCKET={BUCKET}",
        "-e",
        "VLLM_ARGS=--max-model-len 4096 --gpu-memory-utilization 0.85",
        *J,
    ]
    roles = ("vllm-0", "vllm-1", "wordle", "dashboard")
    assert hub.calls() == [
        *deploy_head(),
        *infos(*roles),
        ["repos", "duplicate", "bob/deltasync-vllm-0", "alice/deltasync-vllm-0", *vllm_settings],
        ["repos", "duplicate", "bob/deltasync-vllm-0", "alice/deltasync-vllm-1", *vllm_settings],
        [
            "repos",
            "duplicate",
            "bob/deltasync-wordle",
            "alice/deltasync-wordle",
            "--type",
            "space",
            "--flavor",
            "cpu-basic",
            "-s",
            "ENV_API_KEY",
            *J,
        ],
        [
            "repos",
            "duplicate",
            "bob/deltasync-dashboard",
            "alice/deltasync-dashboard",
            "--type",
            "space",
            "--flavor",
            "cpu-basic",
            "-s",
            "HF_TOKEN",
            "-e",
            f"DELTASYNC_BUCKET={BUCKET}",
            "-e",
            replicas_variable(2),
            *J,
        ],
        *infos(*roles),
    ]
    assert not any(c[0] == "upload" for c in hub.calls())
    assert hub.state["spaces"]["alice/deltasync-vllm-1"]["secrets"]["DELTASYNC_API_KEY"]

    hub.clear_calls()  # a re-run re-applies the settings, duplicates nothing
    assert hub.launch("--model", MODEL, "--no-train", "--from-template", "bob").code == 0
    assert not any(c[:2] == ["repos", "duplicate"] for c in hub.calls())
    settings = ["--hardware", "a10g-small", "--sleep-time", "3600", *J]
    assert ["spaces", "settings", "alice/deltasync-vllm-0", *settings] in hub.calls()


def test_teardown_deletes_what_launch_made(hub):
    assert hub.launch("--model", MODEL, "--no-train", "--replicas", "2").code == 0
    state = hub.state
    state["spaces"]["alice/unrelated"] = dict(state["spaces"]["alice/deltasync-wordle"])
    hub.state = state
    hub.clear_calls()
    # --replicas 1 at teardown still finds vllm-1 (it probes until a replica is missing)
    result = hub.launch("--teardown", "--yes")
    assert result.code == 0, result.err
    assert hub.calls() == [
        *head(),
        *infos("vllm-0", "vllm-1", "vllm-2", "wordle", "dashboard"),
        *[
            ["repos", "delete", f"alice/deltasync-{r}", "--type", "space", "-y", "--missing-ok", *J]
            for r in ("vllm-0", "vllm-1", "wordle", "dashboard")
        ],
        ["buckets", "delete", BUCKET_ID, "-y", "--missing-ok", *J],
    ]
    assert set(hub.state["spaces"]) == {"alice/unrelated"}
    assert hub.state["buckets"] == {}
    assert not (hub.workdir / "api-key-alice-deltasync").exists()


def test_teardown_asks_and_declining_deletes_nothing(hub):
    assert hub.launch("--model", MODEL, "--no-train").code == 0
    before = hub.state
    hub.clear_calls()
    result = hub.launch("--teardown", stdin="n\n")
    assert result.code == 1
    assert "Delete these 4" in result.out and "nothing deleted" in result.out
    assert not any(c[1] == "delete" for c in hub.calls())
    assert hub.state["spaces"].keys() == before["spaces"].keys()

    hub.clear_calls()
    result = hub.launch("--teardown", "--keep-bucket", stdin="y\n")
    assert result.code == 0 and hub.state["spaces"] == {}
    assert BUCKET_ID in hub.state["buckets"]


def test_teardown_skips_a_space_it_did_not_make(hub):
    hub.update(
        spaces={
            "alice/deltasync-dashboard": {
                "sdk": "gradio",
                "private": False,
                "hardware": "cpu-basic",
                "secrets": {},
                "variables": {},
                "tags": [],
                "sha": "a" * 40,
                "stage": "RUNNING",
                "stages": [],
            }
        }
    )
    result = hub.launch("--teardown", "--yes", "--keep-bucket")
    assert result.code == 0
    assert "skipping alice/deltasync-dashboard" in result.out and "nothing to delete" in result.out
    assert "alice/deltasync-dashboard" in hub.state["spaces"]


def test_starts_the_trainer_pointed_at_the_spaces(hub, tmp_path, monkeypatch):
    """Without --no-train the trainer runs here; a stand-in Python records its argv and env."""
    record = tmp_path / "trainer.json"
    fake_py = tmp_path / "python"
    fake_py.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'key': os.environ.get('DELTASYNC_API_KEY')}}, "
        f"open({str(record)!r}, 'w'))\nprint('Weight sync: done. Total 0.1s')\n"
    )
    fake_py.chmod(0o755)
    import launcher.commands

    monkeypatch.setattr(launcher.commands, "PY", str(fake_py))
    result = hub.launch("--model", MODEL, "--run-name", "r1", "--steps", "5", "--", "--lr", "1e-6")
    assert result.code == 0, result.err + result.out
    ran = json.loads(record.read_text())
    assert ran["argv"] == [
        "-m",
        "trainer.train",
        "--model",
        MODEL,
        "--bucket",
        BUCKET,
        "--run-id",
        "r1",
        "--steps",
        "5",
        "--env",
        "wordle",
        "--env-url",
        "https://alice-deltasync-wordle.hf.space",
        "--vllm-server-url",
        "https://alice-deltasync-vllm-0.hf.space",
        "--lr",
        "1e-6",
    ]
    assert ran["key"] == (hub.workdir / "api-key-alice-deltasync").read_text().strip()
    assert (
        ran["key"] == hub.state["spaces"]["alice/deltasync-vllm-0"]["secrets"]["DELTASYNC_API_KEY"]
    )


def test_api_key_from_the_environment_is_used_and_not_saved(hub, monkeypatch):
    monkeypatch.setenv("DELTASYNC_API_KEY", "from-env-0123456789")
    assert hub.launch("--model", MODEL, "--no-train").code == 0
    secrets = hub.state["spaces"]["alice/deltasync-vllm-0"]["secrets"]
    assert secrets["DELTASYNC_API_KEY"] == "from-env-0123456789"
    assert not (hub.workdir / "api-key-alice-deltasync").exists()


def test_namespace_must_be_yours(hub):
    assert hub.launch("--model", MODEL, "--no-train", "--namespace", "team").code == 0
    assert "team/deltasync-vllm-0" in hub.state["spaces"]
    result = hub.launch("--model", MODEL, "--no-train", "--namespace", "carol")
    assert result.code == 1
    assert "--namespace carol: you are logged in as alice (orgs: team)" in result.err


def _visibility(hub) -> dict[str, bool]:
    state = hub.state
    return {
        "bucket": state["buckets"][BUCKET_ID]["private"],
        **{repo.split("-", 1)[1]: space["private"] for repo, space in state["spaces"].items()},
    }


def test_reruns_apply_visibility_both_ways(hub):
    """`--private` on a re-run makes the bucket and dashboard private; a re-run without it makes
    them public again; a replica made private by hand is made public (its token guards it)."""
    assert hub.launch("--model", MODEL, "--no-train").code == 0
    public = {"bucket": False, "vllm-0": False, "wordle": False, "dashboard": False}
    assert _visibility(hub) == public
    hub.clear_calls()

    result = hub.launch("--model", MODEL, "--no-train", "--private")
    assert result.code == 0, result.err
    assert _visibility(hub) == {**public, "bucket": True, "dashboard": True}
    calls = hub.calls()
    assert ["buckets", "settings", BUCKET_ID, "--private", *J] in calls
    dashboard = ["repos", "settings", "alice/deltasync-dashboard", "--type", "space"]
    assert [*dashboard, "--private", *J] in calls
    assert [c for c in calls if c[:2] in (["repos", "settings"], ["buckets", "settings"])] == [
        ["buckets", "settings", BUCKET_ID, "--private", *J],
        [*dashboard, "--private", *J],
    ]  # only what differs is changed
    assert "visibility: public -> private" in result.out

    state = hub.state
    state["spaces"]["alice/deltasync-vllm-0"]["private"] = True  # by hand, in the settings
    hub.state = state
    hub.clear_calls()
    result = hub.launch("--model", MODEL, "--no-train")
    assert result.code == 0, result.err
    assert _visibility(hub) == public
    assert [
        c for c in hub.calls() if c[:2] in (["repos", "settings"], ["buckets", "settings"])
    ] == [
        ["buckets", "settings", BUCKET_ID, "--public", *J],
        ["repos", "settings", "alice/deltasync-vllm-0", "--type", "space", "--public", *J],
        [*dashboard, "--public", *J],
    ]


def test_gpu_replicas_get_a_sleep_time_and_cpu_spaces_none(hub):
    assert hub.launch("--model", MODEL, "--no-train", "--sleep-time", "900").code == 0
    spaces = hub.state["spaces"]
    assert spaces["alice/deltasync-vllm-0"]["sleep_time"] == 900
    assert "sleep_time" not in spaces["alice/deltasync-wordle"]
    assert "sleep_time" not in spaces["alice/deltasync-dashboard"]
    hub.clear_calls()

    assert hub.launch("--model", MODEL, "--no-train", "--sleep-time", "-1").code == 0
    assert hub.state["spaces"]["alice/deltasync-vllm-0"]["sleep_time"] == -1  # re-applied
    hub.clear_calls()

    # CPU hardware (no accelerator in `hf spaces hardware`) gets no sleep time
    result = hub.launch(
        "--model", MODEL, "--no-train", "--vllm-flavor", "cpu-upgrade", "--name", "c"
    )
    assert result.code == 0, result.err
    create = next(c for c in hub.calls() if c[:3] == ["repos", "create", "alice/c-vllm-0"])
    assert "--flavor" in create and "--sleep-time" not in create
    assert "sleep_time" not in hub.state["spaces"]["alice/c-vllm-0"]


def test_read_token_goes_to_the_spaces_that_read_the_bucket(hub, monkeypatch):
    """DELTASYNC_READ_TOKEN becomes HF_TOKEN of the replicas and the dashboard, through stdin
    (never argv, never printed), at creation and again on a re-run."""
    token = "hf_readonlyFineGrained0123"
    monkeypatch.setenv("DELTASYNC_READ_TOKEN", token)
    result = hub.launch("--model", MODEL, "--no-train")
    assert result.code == 0, result.err
    spaces = hub.state["spaces"]
    assert spaces["alice/deltasync-vllm-0"]["secrets"]["HF_TOKEN"] == token
    assert spaces["alice/deltasync-dashboard"]["secrets"]["HF_TOKEN"] == token
    assert "HF_TOKEN" not in spaces["alice/deltasync-wordle"]["secrets"]
    assert token not in result.out + result.err
    assert all(token not in " ".join(c) for c in hub.calls())
    create = next(c for c in hub.calls() if c[:3] == ["repos", "create", "alice/deltasync-vllm-0"])
    assert "--secrets-file" in create and "HF_TOKEN" not in create

    state = hub.state  # the login's token put there by hand (or by a launch without the variable)
    state["spaces"]["alice/deltasync-vllm-0"]["secrets"]["HF_TOKEN"] = "hf_stored_token"
    hub.state = state
    hub.clear_calls()
    assert hub.launch("--model", MODEL, "--no-train").code == 0
    assert hub.state["spaces"]["alice/deltasync-vllm-0"]["secrets"]["HF_TOKEN"] == token


def test_a_bad_read_token_is_refused_before_anything_is_made(hub, monkeypatch):
    monkeypatch.setenv("DELTASYNC_READ_TOKEN", "hf_x y\nHF_OTHER=1")
    result = hub.launch("--model", MODEL, "--no-train")
    assert result.code == 1
    assert "DELTASYNC_READ_TOKEN is not a Hugging Face token" in result.err
    assert hub.state["spaces"] == {} and hub.state["buckets"] == {}
