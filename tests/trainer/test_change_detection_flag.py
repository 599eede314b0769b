"""`--change-detection` picks where the trainer's publisher finds each step's changes."""

from __future__ import annotations

import pytest

from trainer.publishing import publisher_config
from trainer.train import build_parser


@pytest.mark.parametrize("mode", ["auto", "host", "device"])
def test_the_flag_reaches_the_publisher_config(mode):
    args = build_parser().parse_args(["--change-detection", mode])
    assert publisher_config(args, "run", None).change_detection == mode


def test_auto_by_default_and_other_modes_refused(capsys):
    assert publisher_config(build_parser().parse_args([]), "run", None).change_detection == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--change-detection", "gpu"])
    assert "--change-detection" in capsys.readouterr().err
