"""Checkpoints in S3: fast multipart uploads, manifest-last publishing, verified restore.

Use ``CheckpointStore`` (store.py); the layout and manifest models live in
fleetd.protocol.checkpoints so the controller reads exactly what the agent writes.
"""

from agent.checkpoint_store.errors import (
    CheckpointCorrupt,
    ObjectNotFound,
    PreconditionFailed,
    StoreError,
    StoreUnavailable,
)
from agent.checkpoint_store.restore import RestoredCheckpoint
from agent.checkpoint_store.store import CheckpointStore, UploadResult
from agent.checkpoint_store.uploader import UploadTuning

__all__ = [
    "CheckpointCorrupt",
    "CheckpointStore",
    "ObjectNotFound",
    "PreconditionFailed",
    "RestoredCheckpoint",
    "StoreError",
    "StoreUnavailable",
    "UploadResult",
    "UploadTuning",
]
