"""The FSDP2 hook's wiring into TRL's trainer (the ranks' publishing itself runs under torchrun
in tests/scale): which rank sends what, barriers, the model version, TRL's own path when off."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import torch

from trainer.sharded import ShardedBucketSync, fsdp2_launched, sharded_trainer_class

ROOT = Path(__file__).resolve().parents[2]


class _Recorder:
    def __init__(self):
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        def record(*args):
            self.calls.append((name, *args))
            if name == "publish":
                from concurrent.futures import Future

                done: Future = Future()
                done.set_result(None)
                return done
            return None

        return record


class _TrlStandIn:
    """What the mixin calls on TRL's side; `_sync_weight_merged` is TRL's own path."""

    def __init__(self, main: bool):
        self.model = torch.nn.Linear(3, 2)
        self.barriers = 0
        self.accelerator = SimpleNamespace(
            is_main_process=main,
            wait_for_everyone=self._barrier,
            unwrap_model=lambda m: m,
        )
        self.weight_transfer = _Recorder() if main else None  # TRL builds it on rank 0 only
        self.rollout_worker = _Recorder() if main else None
        self.model_version = 0
        self.trl_path = 0

    def _barrier(self):
        self.barriers += 1

    def _sync_weight_merged(self, t0):
        self.trl_path += 1
        return t0, t0, t0


class _Trainer(ShardedBucketSync, _TrlStandIn):
    pass


def test_rank_0_hands_its_shards_to_the_transfer_and_bumps_the_version():
    trainer = _Trainer(main=True)
    trainer.rank_publisher = _Recorder()
    marks = trainer._sync_weight_merged(0.0)
    calls = [c[0] for c in trainer.weight_transfer.calls]
    assert calls == ["pause", "send_weights", "resume"]
    sent = list(trainer.weight_transfer.calls[1][1])
    assert [n for n, _ in sent] == ["weight", "bias"]
    assert all(isinstance(t, torch.nn.Parameter) for _, t in sent)  # no gather, no copy
    assert trainer.rank_publisher.calls == []  # rank 0 publishes through the transfer
    assert trainer.barriers == 2 and trainer.model_version == 1 and trainer.trl_path == 0
    assert trainer.rollout_worker.calls == [("update_model_version", 1)]
    assert len(marks) == 3 and marks[0] <= marks[1] <= marks[2]


def test_other_ranks_publish_their_own_part():
    trainer = _Trainer(main=False)
    trainer.rank_publisher = _Recorder()
    trainer._sync_weight_merged(0.0)
    (call,) = trainer.rank_publisher.calls
    assert call[0] == "publish" and [n for n, _ in call[1]] == ["weight", "bias"]
    assert trainer.barriers == 2 and trainer.model_version == 0 and trainer.trl_path == 0


def test_without_a_rank_publisher_trl_syncs_as_it_does():
    trainer = _Trainer(main=True)
    trainer._sync_weight_merged(0.0)
    assert trainer.trl_path == 1 and trainer.weight_transfer.calls == []


def test_the_hook_replaces_trl_s_gathering_method():
    """The method TRL's sync dispatches to is the one the mixin overrides (guards a TRL upgrade
    that renames it), and TRL's version all-gathers (`full_tensor`), which the hook avoids."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    cls = sharded_trainer_class()
    assert issubclass(cls, AsyncGRPOTrainer)
    assert cls._sync_weight_merged is ShardedBucketSync._sync_weight_merged
    assert "self._sync_weight_merged(" in inspect.getsource(AsyncGRPOTrainer._sync_weight)
    assert "full_tensor()" in inspect.getsource(AsyncGRPOTrainer._streaming_iter)


def test_a_single_process_is_not_an_fsdp2_launch():
    assert not fsdp2_launched()


def test_the_documented_accelerate_config_is_fsdp2():
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ROOT / "trainer" / "accelerate_fsdp2.yaml"))
    assert config.distributed_type == "FSDP" and config.fsdp_config["fsdp_version"] == 2
