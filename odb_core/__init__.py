"""ODB protocol core: pure-Python, sans-IO Online Dynamic Batching.

No torch, no sockets, no processes, no sleeping: plain data in, plain data out.
Properties P1-P8 are the guarantees tabled in the README ("Guarantees") and cited in docstrings.
"""

from odb_core.audit import Audit, audit
from odb_core.config import ODBConfig
from odb_core.errors import (
    CheckpointStateError,
    CollateFnError,
    CollateProcessError,
    ConfigMismatchError,
    DescriptorLimitError,
    InvalidSampleError,
    LoaderStateError,
    LossTokenMismatchError,
    NonJoinStalledError,
    ODBError,
    ODBWarning,
    PackedAttentionCostWarning,
    PackedAttentionError,
    PeerError,
    PeerInconsistencyError,
    PinMemoryError,
    ProtocolStateError,
    ResumeStateError,
    RoundBoundError,
    SampleLoadError,
    StartMethodError,
    UnsupportedSettingError,
    WireFormatError,
)
from odb_core.grouping import batch_size_for, form_groups
from odb_core.loss import step_weights
from odb_core.packing import pack_groups
from odb_core.protocol import Phase, Plan, RankProtocol, Step
from odb_core.quota import QuotaTracker
from odb_core.sampler import permutation, shard_views
from odb_core.simulator import SimResult, simulate
from odb_core.wire import Header, Status

__all__ = [
    "Audit",
    "CheckpointStateError",
    "CollateFnError",
    "CollateProcessError",
    "ConfigMismatchError",
    "DescriptorLimitError",
    "Header",
    "InvalidSampleError",
    "LoaderStateError",
    "LossTokenMismatchError",
    "NonJoinStalledError",
    "ODBConfig",
    "ODBError",
    "ODBWarning",
    "PackedAttentionCostWarning",
    "PackedAttentionError",
    "PeerError",
    "PeerInconsistencyError",
    "Phase",
    "PinMemoryError",
    "Plan",
    "ProtocolStateError",
    "QuotaTracker",
    "RankProtocol",
    "ResumeStateError",
    "RoundBoundError",
    "SampleLoadError",
    "SimResult",
    "StartMethodError",
    "Status",
    "Step",
    "UnsupportedSettingError",
    "WireFormatError",
    "audit",
    "batch_size_for",
    "form_groups",
    "pack_groups",
    "permutation",
    "shard_views",
    "simulate",
    "step_weights",
]
