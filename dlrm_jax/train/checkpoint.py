"""Checkpoints of the whole train state with orbax, restorable onto any mesh."""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp


class Checkpoints:
    """Asynchronous sharded saves under ``directory``; restores onto the current mesh's shardings.

    An interrupted save never becomes the newest checkpoint: orbax writes to a temporary folder
    and renames it only once complete.
    """

    def __init__(self, directory: Path, keep: int):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self._manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state, plan_json: str) -> None:
        """Saves the state with the embedding plan that laid its tables out."""
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), plan=ocp.args.JsonSave({"plan": plan_json})))

    def _step(self, step: int | None) -> int:
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError("no checkpoint to restore")
        return step

    def saved_plan(self, step: int | None = None) -> str:
        """The JSON of the plan the checkpoint at ``step`` (default newest) was saved with."""
        out = self._manager.restore(self._step(step), args=ocp.args.Composite(plan=ocp.args.JsonRestore()))
        return out.plan["plan"]

    def restore(self, abstract_state, step: int | None = None):
        """The state at ``step`` (default newest), laid out like ``abstract_state``'s shardings."""
        out = self._manager.restore(self._step(step),
                                    args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
        return out.state

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
