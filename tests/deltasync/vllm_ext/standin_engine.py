"""What the stand-in engine clients of the control-plane tests share: vLLM's `AsyncLLM` as the
control plane reads it through the app (`app.state.engine_client`) and records versions."""

from __future__ import annotations


class StandInEngine:
    """The app, its state and its engine client in one object; `calls` records what happened."""

    weight_version: str
    calls: list[str]

    @property
    def state(self):
        return self

    @property
    def engine_client(self):
        return self

    async def get_weight_version(self):
        return self.weight_version

    async def update_weight_version(self, version):
        self.calls.append(f"record {version}")
        self.weight_version = version
