"""How long every replica must fail `/health` before the trainer stops the run: seconds for
replicas on this machine, minutes for remote ones (a Space restarts in minutes), or the flag."""

from __future__ import annotations

import pytest

from trainer.train import _down_after, build_parser


@pytest.mark.parametrize(
    ("urls", "seconds"),
    [
        (["http://127.0.0.1:8001", "http://localhost:8011"], 10.0),
        (["https://alice-deltasync-vllm-0.hf.space"], 300.0),
        (["http://127.0.0.1:8001", "https://alice-deltasync-vllm-1.hf.space"], 300.0),
    ],
)
def test_the_default_depends_on_where_the_replicas_are(urls, seconds):
    assert _down_after(urls) == seconds


def test_the_flag_overrides_it_and_must_be_positive(capsys):
    assert build_parser().parse_args(["--replica-down-after", "45"]).replica_down_after == 45.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--replica-down-after", "0"])
    assert "--replica-down-after" in capsys.readouterr().err
