"""The running page in headless Chromium: its DOM holds the charts' marks, its PNG shows them;
the same page from the dashboard Space's image, run as a container (podman).

Needs Debian's `chromium` (apt-get install -y chromium). To refresh the README picture:
    DASHBOARD_SCREENSHOT=docs/dashboard.png python -m pytest -q tests/dashboard/test_screenshot.py
"""

from __future__ import annotations

import contextlib
import html
import os
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image
from server_process import free_port

# Gradio 6.31's own per-event analytics table (queueing.py) trips pandas 3 deprecations.
pytestmark = [
    pytest.mark.filterwarnings("ignore:'future.no_silent_downcasting' is deprecated"),
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]
BROWSER_TIMEOUT_S = 90
CONTAINER_START_S = 120
WINDOW = (1400, 1150)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    f"--window-size={WINDOW[0]},{WINDOW[1]}",
    "--virtual-time-budget=20000",
]


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if found := shutil.which(name):
            return found
    pytest.fail("chromium is not on PATH: install it with `apt-get install -y chromium` (Debian)")


def run_browser(args: list[str], profile: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [chromium(), *FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=BROWSER_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def add_replica_timings_and_reward(trainer, versions: range) -> None:
    """What a full trainer writes in each metrics record: replica outcomes and the reward."""
    for v in versions:
        replicas = {
            f"vllm-{r}": (0.30 + 0.02 * ((v * (r + 3)) % 5), 0.02 + 0.004 * ((v + r) % 3))
            for r in range(2)
        }
        trainer.complete(v, replicas, None if v == 1 else round(0.1 + 0.6 * (1 - 0.85**v), 4))


def test_page_shows_charts_with_data(trainer, launch, tmp_path):
    trainer.publish(12)
    add_replica_timings_and_reward(trainer, range(1, 13))
    check_charts(launch(trainer.store.root), tmp_path)


@pytest.mark.slow  # builds (or reuses) the dashboard Space's image and runs it in podman
# Alone on the machine: Chromium renders within a 20 s virtual-time budget, and beside another
# test, on one core with the container's server, the page once had no chart by then.
@pytest.mark.whole_machine
def test_the_dashboard_space_container_shows_the_same_charts(trainer, tmp_path):
    """The image Spaces build from the dashboard's card, run as a Space runs it (uid 1000, the
    bucket from DELTASYNC_BUCKET, port 7860), renders the same page."""
    trainer.publish(12)
    add_replica_timings_and_reward(trainer, range(1, 13))
    with dashboard_container(Path(trainer.store.root), tmp_path) as url:
        check_charts(url, tmp_path)


@contextlib.contextmanager
def dashboard_container(bucket: Path, tmp_path: Path) -> Iterator[str]:
    from launcher.containers.bases import ensure_bases
    from launcher.containers.engine import find_engine
    from launcher.containers.images import build_space_image

    engine = find_engine()
    image = build_space_image(engine, "dashboard", tmp_path, ensure_bases(engine, print), print)
    name, port = f"deltasync-test-dashboard-{os.getpid()}", free_port()
    url = f"http://127.0.0.1:{port}/"
    try:
        engine.run(
            "run", "-d", "--rm", "--name", name, "-p", f"127.0.0.1:{port}:{image.app_port}",
            "-v", f"{bucket}:{bucket}:ro", "--env", f"DELTASYNC_BUCKET={bucket}", image.tag,
        )  # fmt: skip
        deadline = time.monotonic() + CONTAINER_START_S
        while not _answers(url):
            assert time.monotonic() < deadline, engine.run("logs", name, check=False).stdout[-2000:]
            time.sleep(0.5)
        yield url
    finally:
        engine.run("rm", "-f", "-t", "0", name, check=False)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def check_charts(url: str, tmp_path: Path) -> None:
    """The five charts with their marks in the DOM, and a PNG that is not blank."""
    dom = run_browser(["--dump-dom", url], tmp_path / "profile-dom").stdout
    labels = [html.unescape(s) for s in re.findall(r'aria-label="([^"]*)"', dom)]
    assert dom.count('data-testid="altair"') == 5
    widths = [int(w) for w in re.findall(r'<svg[^>]*class="marks"[^>]*width="(\d+)"', dom)]
    assert len(widths) == 5 and min(widths) > 300, widths
    assert any(lab.startswith("version: 12; sparsity: ") for lab in labels)
    assert any("titled 'bytes (log scale)' for a log scale" in lab for lab in labels)
    assert any(re.fullmatch(r"version: 5; .*file: anchor; bytes: \d+", lab) for lab in labels)
    assert any(re.fullmatch(r"version: 12; .*file: delta; bytes: \d+", lab) for lab in labels)
    assert any("series: vllm-1 pause" in lab for lab in labels)
    assert any(re.fullmatch(r"version: 12; seconds: [\d.]+; series: vllm-1", lab) for lab in labels)
    assert any(re.fullmatch(r"step: 11; .*version: 12; reward: [\d.]+", lab) for lab in labels)
    assert "replay cost for a new replica" in dom
    assert "replicas have not reported" not in dom

    png = tmp_path / "dashboard.png"
    run_browser([f"--screenshot={png}", url], tmp_path / "profile-png")
    image = Image.open(png).convert("RGB")
    assert image.size == WINDOW
    charts = image.crop((0, 120, WINDOW[0], 700)).resize((350, 145))
    colours = {c for _, c in charts.getcolors(350 * 145) or []}
    assert len(colours) > 40, "the chart area is nearly blank"
    if out := os.environ.get("DASHBOARD_SCREENSHOT"):
        shutil.copyfile(png, out)
