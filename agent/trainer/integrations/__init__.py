"""fleetd for training loops a framework owns: a Hugging Face ``TrainerCallback``
(:mod:`agent.trainer.integrations.hf`, ``pip install fleetd[hf]``) and a Lightning ``Callback``
(:mod:`agent.trainer.integrations.lightning`, ``pip install fleetd[lightning]``), both thin layers
over :class:`~agent.trainer.integrations.core.FrameworkSession`, itself over ``ElasticCheckpointer``.
The framework modules import their framework; this package's ``__init__`` imports neither."""

from agent.trainer.integrations.core import FrameworkSession

__all__ = ["FrameworkSession"]
