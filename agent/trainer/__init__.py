"""Training-side helper for scripts run by fleetd's torchrun supervisor: resume from the newest
checkpoint, save periodically and on fleetd's request (all ranks agree on the step), hold while a
leave is pending, report progress to the agent. See :mod:`agent.trainer.elastic`."""

from agent.trainer.context import TrainerContext
from agent.trainer.data import loss_weight, rank_indices, rank_slice, step_indices
from agent.trainer.elastic import ElasticCheckpointer

__all__ = [
    "ElasticCheckpointer",
    "TrainerContext",
    "loss_weight",
    "rank_indices",
    "rank_slice",
    "step_indices",
]
