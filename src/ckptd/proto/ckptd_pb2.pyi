from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SaveState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAVE_STATE_UNSPECIFIED: _ClassVar[SaveState]
    SAVE_STATE_STAGING: _ClassVar[SaveState]
    SAVE_STATE_LOCAL: _ClassVar[SaveState]
    SAVE_STATE_DRAINING: _ClassVar[SaveState]
    SAVE_STATE_DURABLE: _ClassVar[SaveState]
    SAVE_STATE_FAILED: _ClassVar[SaveState]
    SAVE_STATE_SUPERSEDED: _ClassVar[SaveState]

class StepEvent(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_EVENT_UNSPECIFIED: _ClassVar[StepEvent]
    STEP_EVENT_STAGED: _ClassVar[StepEvent]
    STEP_EVENT_LOCAL: _ClassVar[StepEvent]
    STEP_EVENT_FAILED: _ClassVar[StepEvent]
    STEP_EVENT_DRAINING: _ClassVar[StepEvent]
    STEP_EVENT_RETRYING: _ClassVar[StepEvent]
    STEP_EVENT_REQUEUED: _ClassVar[StepEvent]
    STEP_EVENT_DURABLE: _ClassVar[StepEvent]
    STEP_EVENT_SUPERSEDED: _ClassVar[StepEvent]
    STEP_EVENT_RECOVERED: _ClassVar[StepEvent]
    STEP_EVENT_DISCOVERED: _ClassVar[StepEvent]
    STEP_EVENT_FETCHED: _ClassVar[StepEvent]
    STEP_EVENT_PEERS_FETCHED: _ClassVar[StepEvent]
    STEP_EVENT_EVICTED_LOCAL: _ClassVar[StepEvent]
    STEP_EVENT_EVICTED_REMOTE: _ClassVar[StepEvent]
    STEP_EVENT_SET_ASIDE: _ClassVar[StepEvent]
    STEP_EVENT_PINNED: _ClassVar[StepEvent]
    STEP_EVENT_UNPINNED: _ClassVar[StepEvent]
    STEP_EVENT_ABANDONED: _ClassVar[StepEvent]
    STEP_EVENT_REPLICATED: _ClassVar[StepEvent]
    STEP_EVENT_TIMELINE: _ClassVar[StepEvent]
    STEP_EVENT_REPLACED: _ClassVar[StepEvent]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_LOCAL: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]
    TIER_PEER: _ClassVar[Tier]
    TIER_MEMORY: _ClassVar[Tier]
SAVE_STATE_UNSPECIFIED: SaveState
SAVE_STATE_STAGING: SaveState
SAVE_STATE_LOCAL: SaveState
SAVE_STATE_DRAINING: SaveState
SAVE_STATE_DURABLE: SaveState
SAVE_STATE_FAILED: SaveState
SAVE_STATE_SUPERSEDED: SaveState
STEP_EVENT_UNSPECIFIED: StepEvent
STEP_EVENT_STAGED: StepEvent
STEP_EVENT_LOCAL: StepEvent
STEP_EVENT_FAILED: StepEvent
STEP_EVENT_DRAINING: StepEvent
STEP_EVENT_RETRYING: StepEvent
STEP_EVENT_REQUEUED: StepEvent
STEP_EVENT_DURABLE: StepEvent
STEP_EVENT_SUPERSEDED: StepEvent
STEP_EVENT_RECOVERED: StepEvent
STEP_EVENT_DISCOVERED: StepEvent
STEP_EVENT_FETCHED: StepEvent
STEP_EVENT_PEERS_FETCHED: StepEvent
STEP_EVENT_EVICTED_LOCAL: StepEvent
STEP_EVENT_EVICTED_REMOTE: StepEvent
STEP_EVENT_SET_ASIDE: StepEvent
STEP_EVENT_PINNED: StepEvent
STEP_EVENT_UNPINNED: StepEvent
STEP_EVENT_ABANDONED: StepEvent
STEP_EVENT_REPLICATED: StepEvent
STEP_EVENT_TIMELINE: StepEvent
STEP_EVENT_REPLACED: StepEvent
TIER_UNSPECIFIED: Tier
TIER_LOCAL: Tier
TIER_REMOTE: Tier
TIER_PEER: Tier
TIER_MEMORY: Tier

class AcquireLeaseRequest(_message.Message):
    __slots__ = ("job", "size_bytes", "wait_seconds", "rank", "reuse_image", "reserve")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    REUSE_IMAGE_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    job: str
    size_bytes: int
    wait_seconds: float
    rank: int
    reuse_image: bool
    reserve: bool
    def __init__(self, job: _Optional[str] = ..., size_bytes: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., rank: _Optional[int] = ..., reuse_image: _Optional[bool] = ..., reserve: _Optional[bool] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "segment", "size_bytes", "alignment", "holds_image", "holds_step", "waits_for_word")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    HOLDS_IMAGE_FIELD_NUMBER: _ClassVar[int]
    HOLDS_STEP_FIELD_NUMBER: _ClassVar[int]
    WAITS_FOR_WORD_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    segment: str
    size_bytes: int
    alignment: int
    holds_image: bool
    holds_step: int
    waits_for_word: bool
    def __init__(self, lease_id: _Optional[str] = ..., segment: _Optional[str] = ..., size_bytes: _Optional[int] = ..., alignment: _Optional[int] = ..., holds_image: _Optional[bool] = ..., holds_step: _Optional[int] = ..., waits_for_word: _Optional[bool] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "client_holds")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_HOLDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    client_holds: bool
    def __init__(self, lease_id: _Optional[str] = ..., client_holds: _Optional[bool] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardDescriptor(_message.Message):
    __slots__ = ("key", "dtype", "shape", "global_shape", "index", "offset", "length")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    key: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    global_shape: _containers.RepeatedScalarFieldContainer[int]
    index: _containers.RepeatedCompositeFieldContainer[SliceSpec]
    offset: int
    length: int
    def __init__(self, key: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., global_shape: _Optional[_Iterable[int]] = ..., index: _Optional[_Iterable[_Union[SliceSpec, _Mapping]]] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ShardTable(_message.Message):
    __slots__ = ("keys", "dtype_names", "dtype_index", "ndim", "shape", "global_shape", "start", "offset", "length")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_NAMES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NDIM_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    dtype_names: _containers.RepeatedScalarFieldContainer[str]
    dtype_index: bytes
    ndim: bytes
    shape: bytes
    global_shape: bytes
    start: bytes
    offset: bytes
    length: bytes
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., dtype_names: _Optional[_Iterable[str]] = ..., dtype_index: _Optional[bytes] = ..., ndim: _Optional[bytes] = ..., shape: _Optional[bytes] = ..., global_shape: _Optional[bytes] = ..., start: _Optional[bytes] = ..., offset: _Optional[bytes] = ..., length: _Optional[bytes] = ...) -> None: ...

class SliceSpec(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class CommitShardsRequest(_message.Message):
    __slots__ = ("lease_id", "job", "step", "rank", "node_ranks", "world_size", "data_offset", "shards", "table", "tree_json", "metadata_json", "milestone", "metrics", "upload_interval_seconds", "incremental", "unchanged_since", "unchanged", "copied_nonce", "copied_at", "copied_holder", "copied_pid", "copied_started", "supersede")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_RANKS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    TREE_JSON_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    MILESTONE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INCREMENTAL_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_SINCE_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    COPIED_NONCE_FIELD_NUMBER: _ClassVar[int]
    COPIED_AT_FIELD_NUMBER: _ClassVar[int]
    COPIED_HOLDER_FIELD_NUMBER: _ClassVar[int]
    COPIED_PID_FIELD_NUMBER: _ClassVar[int]
    COPIED_STARTED_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    job: str
    step: int
    rank: int
    node_ranks: _containers.RepeatedScalarFieldContainer[int]
    world_size: int
    data_offset: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardDescriptor]
    table: ShardTable
    tree_json: str
    metadata_json: str
    milestone: bool
    metrics: _containers.ScalarMap[str, float]
    upload_interval_seconds: float
    incremental: bool
    unchanged_since: int
    unchanged: bytes
    copied_nonce: int
    copied_at: int
    copied_holder: str
    copied_pid: int
    copied_started: int
    supersede: bool
    def __init__(self, lease_id: _Optional[str] = ..., job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., node_ranks: _Optional[_Iterable[int]] = ..., world_size: _Optional[int] = ..., data_offset: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardDescriptor, _Mapping]]] = ..., table: _Optional[_Union[ShardTable, _Mapping]] = ..., tree_json: _Optional[str] = ..., metadata_json: _Optional[str] = ..., milestone: _Optional[bool] = ..., metrics: _Optional[_Mapping[str, float]] = ..., upload_interval_seconds: _Optional[float] = ..., incremental: _Optional[bool] = ..., unchanged_since: _Optional[int] = ..., unchanged: _Optional[bytes] = ..., copied_nonce: _Optional[int] = ..., copied_at: _Optional[int] = ..., copied_holder: _Optional[str] = ..., copied_pid: _Optional[int] = ..., copied_started: _Optional[int] = ..., supersede: _Optional[bool] = ...) -> None: ...

class CommitShardsResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: SaveState
    def __init__(self, state: _Optional[_Union[SaveState, str]] = ...) -> None: ...

class GetSaveStatusRequest(_message.Message):
    __slots__ = ("job", "step", "wait_for", "timeout_seconds")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    wait_for: SaveState
    timeout_seconds: float
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., wait_for: _Optional[_Union[SaveState, str]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class SaveStatus(_message.Message):
    __slots__ = ("job", "step", "state", "error", "ranks_committed", "node_ranks", "handoff_to_local_seconds", "reached", "final", "tiers", "handoff_to_durable_seconds")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RANKS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    NODE_RANKS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_TO_LOCAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REACHED_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_TO_DURABLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    state: SaveState
    error: str
    ranks_committed: _containers.RepeatedScalarFieldContainer[int]
    node_ranks: _containers.RepeatedScalarFieldContainer[int]
    handoff_to_local_seconds: float
    reached: bool
    final: bool
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    handoff_to_durable_seconds: float
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., state: _Optional[_Union[SaveState, str]] = ..., error: _Optional[str] = ..., ranks_committed: _Optional[_Iterable[int]] = ..., node_ranks: _Optional[_Iterable[int]] = ..., handoff_to_local_seconds: _Optional[float] = ..., reached: _Optional[bool] = ..., final: _Optional[bool] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., handoff_to_durable_seconds: _Optional[float] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("job", "step", "state", "tiers", "created_unix", "size_bytes", "num_shards", "milestone", "error", "local_reasons", "remote_reasons", "pinned", "metrics", "adopted", "source", "timeline", "abandoned")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    MILESTONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOCAL_REASONS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REASONS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    state: SaveState
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    created_unix: float
    size_bytes: int
    num_shards: int
    milestone: bool
    error: str
    local_reasons: _containers.RepeatedScalarFieldContainer[str]
    remote_reasons: _containers.RepeatedScalarFieldContainer[str]
    pinned: bool
    metrics: _containers.ScalarMap[str, float]
    adopted: bool
    source: str
    timeline: int
    abandoned: bool
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., state: _Optional[_Union[SaveState, str]] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., created_unix: _Optional[float] = ..., size_bytes: _Optional[int] = ..., num_shards: _Optional[int] = ..., milestone: _Optional[bool] = ..., error: _Optional[str] = ..., local_reasons: _Optional[_Iterable[str]] = ..., remote_reasons: _Optional[_Iterable[str]] = ..., pinned: _Optional[bool] = ..., metrics: _Optional[_Mapping[str, float]] = ..., adopted: _Optional[bool] = ..., source: _Optional[str] = ..., timeline: _Optional[int] = ..., abandoned: _Optional[bool] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints", "history")
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointInfo]
    history: JobHistory
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[CheckpointInfo, _Mapping]]] = ..., history: _Optional[_Union[JobHistory, _Mapping]] = ...) -> None: ...

class JobHistory(_message.Message):
    __slots__ = ("first_seen_unix", "restarts", "restart_unix", "fleet_observed_seconds", "fleet_restarts", "node_observed_seconds", "node_replacements", "node_names")
    FIRST_SEEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    RESTART_UNIX_FIELD_NUMBER: _ClassVar[int]
    FLEET_OBSERVED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FLEET_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    NODE_OBSERVED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NODE_REPLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    NODE_NAMES_FIELD_NUMBER: _ClassVar[int]
    first_seen_unix: float
    restarts: int
    restart_unix: _containers.RepeatedScalarFieldContainer[float]
    fleet_observed_seconds: float
    fleet_restarts: int
    node_observed_seconds: float
    node_replacements: int
    node_names: int
    def __init__(self, first_seen_unix: _Optional[float] = ..., restarts: _Optional[int] = ..., restart_unix: _Optional[_Iterable[float]] = ..., fleet_observed_seconds: _Optional[float] = ..., fleet_restarts: _Optional[int] = ..., node_observed_seconds: _Optional[float] = ..., node_replacements: _Optional[int] = ..., node_names: _Optional[int] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("job", "step", "rank", "shared_memory", "healthy", "copy_on_write")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    COPY_ON_WRITE_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    shared_memory: bool
    healthy: bool
    copy_on_write: bool
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., shared_memory: _Optional[bool] = ..., healthy: _Optional[bool] = ..., copy_on_write: _Optional[bool] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("job", "step", "tier", "directory", "manifest_json", "lease", "data_offset_in_file", "holder_directories")
    class HolderDirectoriesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    DATA_OFFSET_IN_FILE_FIELD_NUMBER: _ClassVar[int]
    HOLDER_DIRECTORIES_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    tier: Tier
    directory: str
    manifest_json: str
    lease: Lease
    data_offset_in_file: int
    holder_directories: _containers.ScalarMap[int, str]
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., directory: _Optional[str] = ..., manifest_json: _Optional[str] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., data_offset_in_file: _Optional[int] = ..., holder_directories: _Optional[_Mapping[int, str]] = ...) -> None: ...

class ReportCorruptRequest(_message.Message):
    __slots__ = ("job", "step", "tier", "detail")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    tier: Tier
    detail: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class ReportCorruptResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("job", "step", "pinned")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    pinned: bool
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., pinned: _Optional[bool] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetRetentionRequest(_message.Message):
    __slots__ = ("job", "policy")
    JOB_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    job: str
    policy: str
    def __init__(self, job: _Optional[str] = ..., policy: _Optional[str] = ...) -> None: ...

class SetRetentionResponse(_message.Message):
    __slots__ = ("local", "remote")
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    local: str
    remote: str
    def __init__(self, local: _Optional[str] = ..., remote: _Optional[str] = ...) -> None: ...

class CheckCapacityRequest(_message.Message):
    __slots__ = ("job", "size_bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    size_bytes: int
    def __init__(self, job: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class Capacity(_message.Message):
    __slots__ = ("ok", "reason", "staging_free_bytes", "local_free_bytes")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STAGING_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    staging_free_bytes: int
    local_free_bytes: int
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., staging_free_bytes: _Optional[int] = ..., local_free_bytes: _Optional[int] = ...) -> None: ...

class FetchPeersRequest(_message.Message):
    __slots__ = ("job", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class PeerPart(_message.Message):
    __slots__ = ("node", "directory", "manifest_json")
    NODE_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    node: str
    directory: str
    manifest_json: str
    def __init__(self, node: _Optional[str] = ..., directory: _Optional[str] = ..., manifest_json: _Optional[str] = ...) -> None: ...

class FetchPeersResponse(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[PeerPart]
    def __init__(self, parts: _Optional[_Iterable[_Union[PeerPart, _Mapping]]] = ...) -> None: ...

class AdoptRequest(_message.Message):
    __slots__ = ("job", "step", "path", "milestone", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MILESTONE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    path: str
    milestone: bool
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., path: _Optional[str] = ..., milestone: _Optional[bool] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class AdoptResponse(_message.Message):
    __slots__ = ("state", "files", "size_bytes")
    STATE_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    state: SaveState
    files: int
    size_bytes: int
    def __init__(self, state: _Optional[_Union[SaveState, str]] = ..., files: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("job", "directory", "layout")
    JOB_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    job: str
    directory: str
    layout: str
    def __init__(self, job: _Optional[str] = ..., directory: _Optional[str] = ..., layout: _Optional[str] = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("directory", "remote_directory")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    REMOTE_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    directory: str
    remote_directory: str
    def __init__(self, directory: _Optional[str] = ..., remote_directory: _Optional[str] = ...) -> None: ...

class EnsureLocalRequest(_message.Message):
    __slots__ = ("job", "step", "directory", "layout")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    directory: str
    layout: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., directory: _Optional[str] = ..., layout: _Optional[str] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("step", "source", "size_bytes")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    step: int
    source: str
    size_bytes: int
    def __init__(self, step: _Optional[int] = ..., source: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class EnsureLocalResponse(_message.Message):
    __slots__ = ("step", "path", "fetched", "linked")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    LINKED_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    fetched: bool
    linked: bool
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ..., fetched: _Optional[bool] = ..., linked: _Optional[bool] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DaemonStatus(_message.Message):
    __slots__ = ("version", "protocol_version", "node_id", "root", "socket", "remote", "uptime_seconds", "staging_budget_bytes", "staging_allocated_bytes", "staging_in_use_bytes", "leases_held", "saves_in_flight", "local_free_bytes", "local_used_bytes", "jobs", "checkpoints", "pid", "drain_queue", "drain_error", "retention_local", "retention_remote", "local_low_watermark_bytes", "local_floor_bytes", "evicted_local", "evicted_remote", "watched_directories", "adopted", "tasks", "job_errors", "last_event_seq", "metrics_address", "remote_endpoint_url", "fetch_in_flight_bytes", "fetch_done_bytes", "peer_address", "peers_known", "replicas_held", "replicas_held_bytes", "replicated_bytes", "peer_fetched_bytes", "peer_error", "peer_data_port", "peer_prestaged_bytes", "peer_served_bytes", "peer_received_bytes", "memory_tier_bytes", "memory_tier_files", "memory_tier_budget_bytes", "memory_tier_steps", "memory_tier_restores", "memory_tier_evicted", "staging_segments_created", "staging_spares_made", "peer_prestaging")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STAGING_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGING_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGING_IN_USE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASES_HELD_FIELD_NUMBER: _ClassVar[int]
    SAVES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DRAIN_QUEUE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_ERROR_FIELD_NUMBER: _ClassVar[int]
    RETENTION_LOCAL_FIELD_NUMBER: _ClassVar[int]
    RETENTION_REMOTE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_LOW_WATERMARK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FLOOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_LOCAL_FIELD_NUMBER: _ClassVar[int]
    EVICTED_REMOTE_FIELD_NUMBER: _ClassVar[int]
    WATCHED_DIRECTORIES_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    JOB_ERRORS_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENDPOINT_URL_FIELD_NUMBER: _ClassVar[int]
    FETCH_IN_FLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    FETCH_DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEERS_KNOWN_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_HELD_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_ERROR_FIELD_NUMBER: _ClassVar[int]
    PEER_DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    PEER_PRESTAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_SERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TIER_FILES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TIER_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TIER_STEPS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TIER_RESTORES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TIER_EVICTED_FIELD_NUMBER: _ClassVar[int]
    STAGING_SEGMENTS_CREATED_FIELD_NUMBER: _ClassVar[int]
    STAGING_SPARES_MADE_FIELD_NUMBER: _ClassVar[int]
    PEER_PRESTAGING_FIELD_NUMBER: _ClassVar[int]
    version: str
    protocol_version: int
    node_id: str
    root: str
    socket: str
    remote: str
    uptime_seconds: float
    staging_budget_bytes: int
    staging_allocated_bytes: int
    staging_in_use_bytes: int
    leases_held: int
    saves_in_flight: int
    local_free_bytes: int
    local_used_bytes: int
    jobs: int
    checkpoints: int
    pid: int
    drain_queue: int
    drain_error: str
    retention_local: str
    retention_remote: str
    local_low_watermark_bytes: int
    local_floor_bytes: int
    evicted_local: int
    evicted_remote: int
    watched_directories: int
    adopted: int
    tasks: _containers.RepeatedCompositeFieldContainer[TaskHealth]
    job_errors: int
    last_event_seq: int
    metrics_address: str
    remote_endpoint_url: str
    fetch_in_flight_bytes: int
    fetch_done_bytes: int
    peer_address: str
    peers_known: int
    replicas_held: int
    replicas_held_bytes: int
    replicated_bytes: int
    peer_fetched_bytes: int
    peer_error: str
    peer_data_port: int
    peer_prestaged_bytes: int
    peer_served_bytes: int
    peer_received_bytes: int
    memory_tier_bytes: int
    memory_tier_files: int
    memory_tier_budget_bytes: int
    memory_tier_steps: int
    memory_tier_restores: int
    memory_tier_evicted: int
    staging_segments_created: int
    staging_spares_made: int
    peer_prestaging: bool
    def __init__(self, version: _Optional[str] = ..., protocol_version: _Optional[int] = ..., node_id: _Optional[str] = ..., root: _Optional[str] = ..., socket: _Optional[str] = ..., remote: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., staging_budget_bytes: _Optional[int] = ..., staging_allocated_bytes: _Optional[int] = ..., staging_in_use_bytes: _Optional[int] = ..., leases_held: _Optional[int] = ..., saves_in_flight: _Optional[int] = ..., local_free_bytes: _Optional[int] = ..., local_used_bytes: _Optional[int] = ..., jobs: _Optional[int] = ..., checkpoints: _Optional[int] = ..., pid: _Optional[int] = ..., drain_queue: _Optional[int] = ..., drain_error: _Optional[str] = ..., retention_local: _Optional[str] = ..., retention_remote: _Optional[str] = ..., local_low_watermark_bytes: _Optional[int] = ..., local_floor_bytes: _Optional[int] = ..., evicted_local: _Optional[int] = ..., evicted_remote: _Optional[int] = ..., watched_directories: _Optional[int] = ..., adopted: _Optional[int] = ..., tasks: _Optional[_Iterable[_Union[TaskHealth, _Mapping]]] = ..., job_errors: _Optional[int] = ..., last_event_seq: _Optional[int] = ..., metrics_address: _Optional[str] = ..., remote_endpoint_url: _Optional[str] = ..., fetch_in_flight_bytes: _Optional[int] = ..., fetch_done_bytes: _Optional[int] = ..., peer_address: _Optional[str] = ..., peers_known: _Optional[int] = ..., replicas_held: _Optional[int] = ..., replicas_held_bytes: _Optional[int] = ..., replicated_bytes: _Optional[int] = ..., peer_fetched_bytes: _Optional[int] = ..., peer_error: _Optional[str] = ..., peer_data_port: _Optional[int] = ..., peer_prestaged_bytes: _Optional[int] = ..., peer_served_bytes: _Optional[int] = ..., peer_received_bytes: _Optional[int] = ..., memory_tier_bytes: _Optional[int] = ..., memory_tier_files: _Optional[int] = ..., memory_tier_budget_bytes: _Optional[int] = ..., memory_tier_steps: _Optional[int] = ..., memory_tier_restores: _Optional[int] = ..., memory_tier_evicted: _Optional[int] = ..., staging_segments_created: _Optional[int] = ..., staging_spares_made: _Optional[int] = ..., peer_prestaging: _Optional[bool] = ...) -> None: ...

class TaskHealth(_message.Message):
    __slots__ = ("name", "state", "restarts", "last_error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: str
    restarts: int
    last_error: str
    def __init__(self, name: _Optional[str] = ..., state: _Optional[str] = ..., restarts: _Optional[int] = ..., last_error: _Optional[str] = ...) -> None: ...

class ListEventsRequest(_message.Message):
    __slots__ = ("job", "after_seq", "wait_seconds", "limit")
    JOB_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    job: str
    after_seq: int
    wait_seconds: float
    limit: int
    def __init__(self, job: _Optional[str] = ..., after_seq: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., limit: _Optional[int] = ...) -> None: ...

class EventRecord(_message.Message):
    __slots__ = ("seq", "time_unix", "kind", "job", "step", "state", "tiers", "detail", "attributes")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time_unix: float
    kind: StepEvent
    job: str
    step: int
    state: SaveState
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    detail: str
    attributes: _containers.ScalarMap[str, str]
    def __init__(self, seq: _Optional[int] = ..., time_unix: _Optional[float] = ..., kind: _Optional[_Union[StepEvent, str]] = ..., job: _Optional[str] = ..., step: _Optional[int] = ..., state: _Optional[_Union[SaveState, str]] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., detail: _Optional[str] = ..., attributes: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListEventsResponse(_message.Message):
    __slots__ = ("events", "last_seq")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[EventRecord]
    last_seq: int
    def __init__(self, events: _Optional[_Iterable[_Union[EventRecord, _Mapping]]] = ..., last_seq: _Optional[int] = ...) -> None: ...

class PeerHelloRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerHelloResponse(_message.Message):
    __slots__ = ("node", "data_port")
    NODE_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    node: str
    data_port: int
    def __init__(self, node: _Optional[str] = ..., data_port: _Optional[int] = ...) -> None: ...

class JobOwner(_message.Message):
    __slots__ = ("uid",)
    UID_FIELD_NUMBER: _ClassVar[int]
    uid: int
    def __init__(self, uid: _Optional[int] = ...) -> None: ...

class ReplicaChunk(_message.Message):
    __slots__ = ("job", "step", "manifest_json", "data", "owner")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    manifest_json: str
    data: bytes
    owner: JobOwner
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., manifest_json: _Optional[str] = ..., data: _Optional[bytes] = ..., owner: _Optional[_Union[JobOwner, _Mapping]] = ...) -> None: ...

class PutReplicaResponse(_message.Message):
    __slots__ = ("size_bytes",)
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    def __init__(self, size_bytes: _Optional[int] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ("job", "source_node")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NODE_FIELD_NUMBER: _ClassVar[int]
    job: str
    source_node: str
    def __init__(self, job: _Optional[str] = ..., source_node: _Optional[str] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("job", "source_node", "step", "manifest_json", "size_bytes", "owner")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NODE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    job: str
    source_node: str
    step: int
    manifest_json: str
    size_bytes: int
    owner: JobOwner
    def __init__(self, job: _Optional[str] = ..., source_node: _Optional[str] = ..., step: _Optional[int] = ..., manifest_json: _Optional[str] = ..., size_bytes: _Optional[int] = ..., owner: _Optional[_Union[JobOwner, _Mapping]] = ...) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("node", "replicas")
    NODE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    node: str
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, node: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class GetReplicaFileRequest(_message.Message):
    __slots__ = ("job", "source_node", "step", "file", "offset")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NODE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    job: str
    source_node: str
    step: int
    file: str
    offset: int
    def __init__(self, job: _Optional[str] = ..., source_node: _Optional[str] = ..., step: _Optional[int] = ..., file: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...
