from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARD_STATE_UNSPECIFIED: _ClassVar[ShardState]
    SHARD_STARTING: _ClassVar[ShardState]
    SHARD_READY: _ClassVar[ShardState]
    SHARD_FAILED: _ClassVar[ShardState]
    SHARD_EXITED: _ClassVar[ShardState]
    SHARD_ASLEEP: _ClassVar[ShardState]
    SHARD_WAKING: _ClassVar[ShardState]
    SHARD_FALLING_ASLEEP: _ClassVar[ShardState]
SHARD_STATE_UNSPECIFIED: ShardState
SHARD_STARTING: ShardState
SHARD_READY: ShardState
SHARD_FAILED: ShardState
SHARD_EXITED: ShardState
SHARD_ASLEEP: ShardState
SHARD_WAKING: ShardState
SHARD_FALLING_ASLEEP: ShardState

class AgentMessage(_message.Message):
    __slots__ = ("hello", "heartbeat", "inventory", "shard_status", "op_result", "cert_request", "draining", "update_status", "kv_events")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    SHARD_STATUS_FIELD_NUMBER: _ClassVar[int]
    OP_RESULT_FIELD_NUMBER: _ClassVar[int]
    CERT_REQUEST_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    UPDATE_STATUS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    heartbeat: Heartbeat
    inventory: Inventory
    shard_status: ShardStatus
    op_result: OperationResult
    cert_request: CertificateRequest
    draining: Draining
    update_status: UpdateStatus
    kv_events: KvEvents
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., inventory: _Optional[_Union[Inventory, _Mapping]] = ..., shard_status: _Optional[_Union[ShardStatus, _Mapping]] = ..., op_result: _Optional[_Union[OperationResult, _Mapping]] = ..., cert_request: _Optional[_Union[CertificateRequest, _Mapping]] = ..., draining: _Optional[_Union[Draining, _Mapping]] = ..., update_status: _Optional[_Union[UpdateStatus, _Mapping]] = ..., kv_events: _Optional[_Union[KvEvents, _Mapping]] = ...) -> None: ...

class KvEvents(_message.Message):
    __slots__ = ("shard_id", "block_size", "cleared", "stored", "removed", "lost")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    block_size: int
    cleared: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    lost: int
    def __init__(self, shard_id: _Optional[str] = ..., block_size: _Optional[int] = ..., cleared: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., lost: _Optional[int] = ...) -> None: ...

class KvRelayed(_message.Message):
    __slots__ = ("node_id", "model", "events")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    model: str
    events: KvEvents
    def __init__(self, node_id: _Optional[str] = ..., model: _Optional[str] = ..., events: _Optional[_Union[KvEvents, _Mapping]] = ...) -> None: ...

class Draining(_message.Message):
    __slots__ = ("deadline_s",)
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    deadline_s: float
    def __init__(self, deadline_s: _Optional[float] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("node_id", "agent_version", "inventory", "shards", "max_epoch", "dataplane_addr")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    MAX_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DATAPLANE_ADDR_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    agent_version: str
    inventory: Inventory
    shards: _containers.RepeatedCompositeFieldContainer[ShardStatus]
    max_epoch: int
    dataplane_addr: str
    def __init__(self, node_id: _Optional[str] = ..., agent_version: _Optional[str] = ..., inventory: _Optional[_Union[Inventory, _Mapping]] = ..., shards: _Optional[_Iterable[_Union[ShardStatus, _Mapping]]] = ..., max_epoch: _Optional[int] = ..., dataplane_addr: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("seq", "inflight", "gpu_utilization")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    GPU_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    seq: int
    inflight: int
    gpu_utilization: _containers.RepeatedCompositeFieldContainer[GpuUtilization]
    def __init__(self, seq: _Optional[int] = ..., inflight: _Optional[int] = ..., gpu_utilization: _Optional[_Iterable[_Union[GpuUtilization, _Mapping]]] = ...) -> None: ...

class GpuUtilization(_message.Message):
    __slots__ = ("uuid", "percent")
    UUID_FIELD_NUMBER: _ClassVar[int]
    PERCENT_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    percent: int
    def __init__(self, uuid: _Optional[str] = ..., percent: _Optional[int] = ...) -> None: ...

class Gpu(_message.Message):
    __slots__ = ("index", "uuid", "name", "memory_total_mib", "memory_used_mib", "utilization_percent", "health")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_MIB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_used_mib: int
    utilization_percent: int
    health: str
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_total_mib: _Optional[int] = ..., memory_used_mib: _Optional[int] = ..., utilization_percent: _Optional[int] = ..., health: _Optional[str] = ...) -> None: ...

class Inventory(_message.Message):
    __slots__ = ("hostname", "arch", "cpus", "memory_total_bytes", "memory_available_bytes", "gpus", "gpu_status", "engines", "driver_version", "gpu_source", "disk_total_bytes", "disk_free_bytes", "engine_details", "ib_adapters", "fabrics", "warnings", "sources", "degraded", "multinode_ports", "warm")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_STATUS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    GPU_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DISK_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_DETAILS_FIELD_NUMBER: _ClassVar[int]
    IB_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    FABRICS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    MULTINODE_PORTS_FIELD_NUMBER: _ClassVar[int]
    WARM_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    arch: str
    cpus: int
    memory_total_bytes: int
    memory_available_bytes: int
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    gpu_status: str
    engines: _containers.RepeatedScalarFieldContainer[str]
    driver_version: str
    gpu_source: str
    disk_total_bytes: int
    disk_free_bytes: int
    engine_details: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    ib_adapters: _containers.RepeatedCompositeFieldContainer[IbAdapter]
    fabrics: _containers.RepeatedCompositeFieldContainer[Fabric]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    sources: ModelSources
    degraded: _containers.RepeatedCompositeFieldContainer[DegradedReason]
    multinode_ports: str
    warm: _containers.RepeatedCompositeFieldContainer[WarmStatus]
    def __init__(self, hostname: _Optional[str] = ..., arch: _Optional[str] = ..., cpus: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., memory_available_bytes: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., gpu_status: _Optional[str] = ..., engines: _Optional[_Iterable[str]] = ..., driver_version: _Optional[str] = ..., gpu_source: _Optional[str] = ..., disk_total_bytes: _Optional[int] = ..., disk_free_bytes: _Optional[int] = ..., engine_details: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ..., ib_adapters: _Optional[_Iterable[_Union[IbAdapter, _Mapping]]] = ..., fabrics: _Optional[_Iterable[_Union[Fabric, _Mapping]]] = ..., warnings: _Optional[_Iterable[str]] = ..., sources: _Optional[_Union[ModelSources, _Mapping]] = ..., degraded: _Optional[_Iterable[_Union[DegradedReason, _Mapping]]] = ..., multinode_ports: _Optional[str] = ..., warm: _Optional[_Iterable[_Union[WarmStatus, _Mapping]]] = ...) -> None: ...

class WarmStatus(_message.Message):
    __slots__ = ("source", "state", "reason", "bytes", "pass_seconds", "last_pass_at")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PASS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_PASS_AT_FIELD_NUMBER: _ClassVar[int]
    source: str
    state: str
    reason: str
    bytes: int
    pass_seconds: float
    last_pass_at: float
    def __init__(self, source: _Optional[str] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., bytes: _Optional[int] = ..., pass_seconds: _Optional[float] = ..., last_pass_at: _Optional[float] = ...) -> None: ...

class DegradedReason(_message.Message):
    __slots__ = ("code", "message", "engine", "fabric")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    FABRIC_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    engine: str
    fabric: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., engine: _Optional[str] = ..., fabric: _Optional[str] = ...) -> None: ...

class ModelSources(_message.Message):
    __slots__ = ("models_root", "entries", "listed_depth", "fetch_prefixes", "cached", "problem")
    MODELS_ROOT_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LISTED_DEPTH_FIELD_NUMBER: _ClassVar[int]
    FETCH_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    models_root: str
    entries: _containers.RepeatedCompositeFieldContainer[ModelSource]
    listed_depth: int
    fetch_prefixes: _containers.RepeatedScalarFieldContainer[str]
    cached: _containers.RepeatedScalarFieldContainer[str]
    problem: str
    def __init__(self, models_root: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[ModelSource, _Mapping]]] = ..., listed_depth: _Optional[int] = ..., fetch_prefixes: _Optional[_Iterable[str]] = ..., cached: _Optional[_Iterable[str]] = ..., problem: _Optional[str] = ...) -> None: ...

class ModelSource(_message.Message):
    __slots__ = ("name", "size_bytes", "dir")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIR_FIELD_NUMBER: _ClassVar[int]
    name: str
    size_bytes: int
    dir: bool
    def __init__(self, name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., dir: _Optional[bool] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("name", "path", "version", "ok", "problem")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    version: str
    ok: bool
    problem: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., version: _Optional[str] = ..., ok: _Optional[bool] = ..., problem: _Optional[str] = ...) -> None: ...

class IbPort(_message.Message):
    __slots__ = ("port", "state", "link_layer", "rate", "gids")
    PORT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LINK_LAYER_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    GIDS_FIELD_NUMBER: _ClassVar[int]
    port: int
    state: str
    link_layer: str
    rate: str
    gids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, port: _Optional[int] = ..., state: _Optional[str] = ..., link_layer: _Optional[str] = ..., rate: _Optional[str] = ..., gids: _Optional[_Iterable[str]] = ...) -> None: ...

class IbAdapter(_message.Message):
    __slots__ = ("name", "ports")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    ports: _containers.RepeatedCompositeFieldContainer[IbPort]
    def __init__(self, name: _Optional[str] = ..., ports: _Optional[_Iterable[_Union[IbPort, _Mapping]]] = ...) -> None: ...

class Fabric(_message.Message):
    __slots__ = ("name", "hcas", "healthy")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HCAS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    name: str
    hcas: _containers.RepeatedScalarFieldContainer[str]
    healthy: bool
    def __init__(self, name: _Optional[str] = ..., hcas: _Optional[_Iterable[str]] = ..., healthy: _Optional[bool] = ...) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("shard_id", "replica_id", "state", "port", "reason", "exit_code", "has_exit_code", "pid", "model", "startup_s", "sleep_level", "host_memory_mib", "transition_ms")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    HAS_EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STARTUP_S_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    TRANSITION_MS_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    replica_id: str
    state: ShardState
    port: int
    reason: str
    exit_code: int
    has_exit_code: bool
    pid: int
    model: str
    startup_s: float
    sleep_level: int
    host_memory_mib: int
    transition_ms: int
    def __init__(self, shard_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., state: _Optional[_Union[ShardState, str]] = ..., port: _Optional[int] = ..., reason: _Optional[str] = ..., exit_code: _Optional[int] = ..., has_exit_code: _Optional[bool] = ..., pid: _Optional[int] = ..., model: _Optional[str] = ..., startup_s: _Optional[float] = ..., sleep_level: _Optional[int] = ..., host_memory_mib: _Optional[int] = ..., transition_ms: _Optional[int] = ...) -> None: ...

class OperationResult(_message.Message):
    __slots__ = ("op_id", "ok", "error", "epoch", "duplicate")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    op_id: str
    ok: bool
    error: str
    epoch: int
    duplicate: bool
    def __init__(self, op_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., epoch: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class CertificateRequest(_message.Message):
    __slots__ = ("csr_pem",)
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    csr_pem: str
    def __init__(self, csr_pem: _Optional[str] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("welcome", "start_shard", "stop_shard", "renew_certificate", "node_state", "refuse", "install_engine", "update_order", "trust_bundle", "control_planes", "heartbeat_ack", "sleep_shard", "wake_shard")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    START_SHARD_FIELD_NUMBER: _ClassVar[int]
    STOP_SHARD_FIELD_NUMBER: _ClassVar[int]
    RENEW_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    NODE_STATE_FIELD_NUMBER: _ClassVar[int]
    REFUSE_FIELD_NUMBER: _ClassVar[int]
    INSTALL_ENGINE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ORDER_FIELD_NUMBER: _ClassVar[int]
    TRUST_BUNDLE_FIELD_NUMBER: _ClassVar[int]
    CONTROL_PLANES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_ACK_FIELD_NUMBER: _ClassVar[int]
    SLEEP_SHARD_FIELD_NUMBER: _ClassVar[int]
    WAKE_SHARD_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    start_shard: StartShard
    stop_shard: StopShard
    renew_certificate: RenewCertificate
    node_state: NodeState
    refuse: Refuse
    install_engine: InstallEngine
    update_order: UpdateOrder
    trust_bundle: TrustBundle
    control_planes: ControlPlanes
    heartbeat_ack: HeartbeatAck
    sleep_shard: SleepShard
    wake_shard: WakeShard
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., start_shard: _Optional[_Union[StartShard, _Mapping]] = ..., stop_shard: _Optional[_Union[StopShard, _Mapping]] = ..., renew_certificate: _Optional[_Union[RenewCertificate, _Mapping]] = ..., node_state: _Optional[_Union[NodeState, _Mapping]] = ..., refuse: _Optional[_Union[Refuse, _Mapping]] = ..., install_engine: _Optional[_Union[InstallEngine, _Mapping]] = ..., update_order: _Optional[_Union[UpdateOrder, _Mapping]] = ..., trust_bundle: _Optional[_Union[TrustBundle, _Mapping]] = ..., control_planes: _Optional[_Union[ControlPlanes, _Mapping]] = ..., heartbeat_ack: _Optional[_Union[HeartbeatAck, _Mapping]] = ..., sleep_shard: _Optional[_Union[SleepShard, _Mapping]] = ..., wake_shard: _Optional[_Union[WakeShard, _Mapping]] = ...) -> None: ...

class HeartbeatAck(_message.Message):
    __slots__ = ("seq", "warm")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    WARM_FIELD_NUMBER: _ClassVar[int]
    seq: int
    warm: WarmSources
    def __init__(self, seq: _Optional[int] = ..., warm: _Optional[_Union[WarmSources, _Mapping]] = ...) -> None: ...

class WarmSources(_message.Message):
    __slots__ = ("sources",)
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedCompositeFieldContainer[WarmSource]
    def __init__(self, sources: _Optional[_Iterable[_Union[WarmSource, _Mapping]]] = ...) -> None: ...

class WarmSource(_message.Message):
    __slots__ = ("source", "sha256")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    source: str
    sha256: str
    def __init__(self, source: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class ControlPlanes(_message.Message):
    __slots__ = ("servers", "retired_serials")
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    RETIRED_SERIALS_FIELD_NUMBER: _ClassVar[int]
    servers: _containers.RepeatedScalarFieldContainer[str]
    retired_serials: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, servers: _Optional[_Iterable[str]] = ..., retired_serials: _Optional[_Iterable[str]] = ...) -> None: ...

class TrustBundle(_message.Message):
    __slots__ = ("ca_pems", "pins", "cross_pems", "drop_at")
    CA_PEMS_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    CROSS_PEMS_FIELD_NUMBER: _ClassVar[int]
    DROP_AT_FIELD_NUMBER: _ClassVar[int]
    ca_pems: _containers.RepeatedScalarFieldContainer[str]
    pins: _containers.RepeatedScalarFieldContainer[str]
    cross_pems: _containers.RepeatedScalarFieldContainer[str]
    drop_at: float
    def __init__(self, ca_pems: _Optional[_Iterable[str]] = ..., pins: _Optional[_Iterable[str]] = ..., cross_pems: _Optional[_Iterable[str]] = ..., drop_at: _Optional[float] = ...) -> None: ...

class Refuse(_message.Message):
    __slots__ = ("leader", "message")
    LEADER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    leader: str
    message: str
    def __init__(self, leader: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class InstallEngine(_message.Message):
    __slots__ = ("meta", "engine", "version", "url", "sha256", "arch")
    META_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    meta: OrderMeta
    engine: str
    version: str
    url: str
    sha256: str
    arch: str
    def __init__(self, meta: _Optional[_Union[OrderMeta, _Mapping]] = ..., engine: _Optional[str] = ..., version: _Optional[str] = ..., url: _Optional[str] = ..., sha256: _Optional[str] = ..., arch: _Optional[str] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("cluster_id", "epoch", "heartbeat_interval_s", "node_id", "node_state", "server_version")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_STATE_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    epoch: int
    heartbeat_interval_s: float
    node_id: str
    node_state: str
    server_version: str
    def __init__(self, cluster_id: _Optional[str] = ..., epoch: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., node_id: _Optional[str] = ..., node_state: _Optional[str] = ..., server_version: _Optional[str] = ...) -> None: ...

class NodeState(_message.Message):
    __slots__ = ("state", "message")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    state: str
    message: str
    def __init__(self, state: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class RenewCertificate(_message.Message):
    __slots__ = ("certificate_pem", "ca_pem", "error")
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    CA_PEM_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    certificate_pem: str
    ca_pem: str
    error: str
    def __init__(self, certificate_pem: _Optional[str] = ..., ca_pem: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class OrderMeta(_message.Message):
    __slots__ = ("epoch", "op_id")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    op_id: str
    def __init__(self, epoch: _Optional[int] = ..., op_id: _Optional[str] = ...) -> None: ...

class StartShard(_message.Message):
    __slots__ = ("meta", "shard_id", "replica_id", "model", "engine", "rank", "params", "extra_args", "gpus", "nodes", "dist_init_addr", "source", "gpu_memory_mib", "sidecars", "profile", "worker_addrs", "listen_addr", "source_sha256", "kv_events", "sandbox", "disagg_role", "transfer_addr")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    META_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_ARGS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    DIST_INIT_ADDR_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    SIDECARS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRS_FIELD_NUMBER: _ClassVar[int]
    LISTEN_ADDR_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SHA256_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    DISAGG_ROLE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDR_FIELD_NUMBER: _ClassVar[int]
    meta: OrderMeta
    shard_id: str
    replica_id: str
    model: str
    engine: str
    rank: int
    params: _containers.ScalarMap[str, str]
    extra_args: _containers.RepeatedScalarFieldContainer[str]
    gpus: _containers.RepeatedScalarFieldContainer[str]
    nodes: int
    dist_init_addr: str
    source: str
    gpu_memory_mib: int
    sidecars: _containers.RepeatedCompositeFieldContainer[Sidecar]
    profile: str
    worker_addrs: _containers.RepeatedScalarFieldContainer[str]
    listen_addr: str
    source_sha256: str
    kv_events: bool
    sandbox: Sandbox
    disagg_role: str
    transfer_addr: str
    def __init__(self, meta: _Optional[_Union[OrderMeta, _Mapping]] = ..., shard_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., model: _Optional[str] = ..., engine: _Optional[str] = ..., rank: _Optional[int] = ..., params: _Optional[_Mapping[str, str]] = ..., extra_args: _Optional[_Iterable[str]] = ..., gpus: _Optional[_Iterable[str]] = ..., nodes: _Optional[int] = ..., dist_init_addr: _Optional[str] = ..., source: _Optional[str] = ..., gpu_memory_mib: _Optional[int] = ..., sidecars: _Optional[_Iterable[_Union[Sidecar, _Mapping]]] = ..., profile: _Optional[str] = ..., worker_addrs: _Optional[_Iterable[str]] = ..., listen_addr: _Optional[str] = ..., source_sha256: _Optional[str] = ..., kv_events: _Optional[bool] = ..., sandbox: _Optional[_Union[Sandbox, _Mapping]] = ..., disagg_role: _Optional[str] = ..., transfer_addr: _Optional[str] = ...) -> None: ...

class Sandbox(_message.Message):
    __slots__ = ("disabled", "extra_ro", "extra_rw")
    DISABLED_FIELD_NUMBER: _ClassVar[int]
    EXTRA_RO_FIELD_NUMBER: _ClassVar[int]
    EXTRA_RW_FIELD_NUMBER: _ClassVar[int]
    disabled: bool
    extra_ro: _containers.RepeatedScalarFieldContainer[str]
    extra_rw: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, disabled: _Optional[bool] = ..., extra_ro: _Optional[_Iterable[str]] = ..., extra_rw: _Optional[_Iterable[str]] = ...) -> None: ...

class Sidecar(_message.Message):
    __slots__ = ("name", "argv", "health_url", "timeout_s", "ready_after_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    HEALTH_URL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    READY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    health_url: str
    timeout_s: float
    ready_after_s: float
    def __init__(self, name: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., health_url: _Optional[str] = ..., timeout_s: _Optional[float] = ..., ready_after_s: _Optional[float] = ...) -> None: ...

class StopShard(_message.Message):
    __slots__ = ("meta", "shard_id", "grace_s", "drain_s")
    META_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    DRAIN_S_FIELD_NUMBER: _ClassVar[int]
    meta: OrderMeta
    shard_id: str
    grace_s: float
    drain_s: float
    def __init__(self, meta: _Optional[_Union[OrderMeta, _Mapping]] = ..., shard_id: _Optional[str] = ..., grace_s: _Optional[float] = ..., drain_s: _Optional[float] = ...) -> None: ...

class SleepShard(_message.Message):
    __slots__ = ("meta", "shard_id", "level")
    META_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    meta: OrderMeta
    shard_id: str
    level: int
    def __init__(self, meta: _Optional[_Union[OrderMeta, _Mapping]] = ..., shard_id: _Optional[str] = ..., level: _Optional[int] = ...) -> None: ...

class WakeShard(_message.Message):
    __slots__ = ("meta", "shard_id")
    META_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    meta: OrderMeta
    shard_id: str
    def __init__(self, meta: _Optional[_Union[OrderMeta, _Mapping]] = ..., shard_id: _Optional[str] = ...) -> None: ...

class UpdateOrder(_message.Message):
    __slots__ = ("meta", "order", "signature")
    META_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    meta: OrderMeta
    order: bytes
    signature: bytes
    def __init__(self, meta: _Optional[_Union[OrderMeta, _Mapping]] = ..., order: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class UpdateStatus(_message.Message):
    __slots__ = ("op_id", "counter", "version", "state", "message")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    op_id: str
    counter: int
    version: str
    state: str
    message: str
    def __init__(self, op_id: _Optional[str] = ..., counter: _Optional[int] = ..., version: _Optional[str] = ..., state: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
