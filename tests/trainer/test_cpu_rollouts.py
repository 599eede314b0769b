"""TRL's rollout worker on a CPU: what waits to be scored is bounded to one group, in the loop
the worker's child process builds (`trainer.cpu.score_one_group_ahead`)."""

from __future__ import annotations

from datasets import Dataset
from trl.chat_template_utils import qwen3_chat_template
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

from trainer.cpu import score_one_group_ahead
from trainer.random_qwen3 import byte_level_tokenizer


def _reward(completions: list, **_: object) -> list[float]:
    return [0.0] * len(completions)


def _worker() -> AsyncRolloutWorker:
    tokenizer = byte_level_tokenizer()
    tokenizer.chat_template = qwen3_chat_template  # as `trainer.config.prepare_model` sets it
    return AsyncRolloutWorker(
        model_name="built",
        dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}]),
        reward_funcs=[_reward],
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        num_generations=2,
        max_inflight_tasks=2,
        queue_maxsize=2,
    )


def _loop(worker: AsyncRolloutWorker):
    """The loop as `_child_main` builds it in the spawned process, from the worker's kwargs."""
    return worker._loop_cls(
        **worker._loop_kwargs,
        rollout_buffer=worker.rollout_buffer,
        model_version_value=worker._model_version_value,
        heartbeat_value=worker._heartbeat_value,
        failed_event=worker._failed_event,
        exception_info_queue=worker._exception_info_queue,
        metrics_queue=worker.metrics_queue,
    )


def test_the_child_loop_scores_one_group_ahead():
    worker = _worker()
    assert _loop(worker)._groups_to_score.maxsize == 16  # TRL's own default
    assert score_one_group_ahead(worker)
    assert _loop(worker)._groups_to_score.maxsize == 1


def test_a_worker_without_the_setting_is_left_alone(caplog):
    class Other:
        def __init__(self) -> None:
            self._loop_kwargs: dict = {}

        def _loop_cls(self, *, queue_maxsize: int = 0) -> None: ...

    other = Other()
    assert not score_one_group_ahead(other)
    assert other._loop_kwargs == {}
    assert "score_queue_maxsize" in caplog.text
