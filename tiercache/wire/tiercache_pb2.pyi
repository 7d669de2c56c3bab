from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ContainsRequest(_message.Message):
    __slots__ = ("namespace", "keys", "each")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    EACH_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    each: bool
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., each: _Optional[bool] = ...) -> None: ...

class ContainsReply(_message.Message):
    __slots__ = ("present", "present_each")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    PRESENT_EACH_FIELD_NUMBER: _ClassVar[int]
    present: int
    present_each: bytes
    def __init__(self, present: _Optional[int] = ..., present_each: _Optional[bytes] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("namespace", "key", "value", "value_len")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    VALUE_LEN_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    key: bytes
    value: bytes
    value_len: int
    def __init__(self, namespace: _Optional[bytes] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., value_len: _Optional[int] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("stored", "present", "rejected")
    STORED_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    present: int
    rejected: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, stored: _Optional[int] = ..., present: _Optional[int] = ..., rejected: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "chunks", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    chunks: int
    counters: _containers.ScalarMap[str, int]
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., chunks: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class HotChunk(_message.Message):
    __slots__ = ("namespace", "key", "hits")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    key: bytes
    hits: int
    def __init__(self, namespace: _Optional[bytes] = ..., key: _Optional[bytes] = ..., hits: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("tiers", "namespaces", "counters", "hot_chunks")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    HOT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    namespaces: int
    counters: _containers.ScalarMap[str, int]
    hot_chunks: _containers.RepeatedCompositeFieldContainer[HotChunk]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., namespaces: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ..., hot_chunks: _Optional[_Iterable[_Union[HotChunk, _Mapping]]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("status", "version", "max_message_bytes", "data_port")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNKNOWN: _ClassVar[HealthReply.Status]
        SERVING: _ClassVar[HealthReply.Status]
        NOT_SERVING: _ClassVar[HealthReply.Status]
    UNKNOWN: HealthReply.Status
    SERVING: HealthReply.Status
    NOT_SERVING: HealthReply.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    status: HealthReply.Status
    version: str
    max_message_bytes: int
    data_port: int
    def __init__(self, status: _Optional[_Union[HealthReply.Status, str]] = ..., version: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., data_port: _Optional[int] = ...) -> None: ...

class LocalRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LocalReply(_message.Message):
    __slots__ = ("directory", "instance")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    directory: str
    instance: str
    def __init__(self, directory: _Optional[str] = ..., instance: _Optional[str] = ...) -> None: ...

class AdoptRequest(_message.Message):
    __slots__ = ("namespace", "keys", "files")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    files: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., files: _Optional[_Iterable[str]] = ...) -> None: ...

class TouchRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TouchReply(_message.Message):
    __slots__ = ("touched",)
    TOUCHED_FIELD_NUMBER: _ClassVar[int]
    touched: int
    def __init__(self, touched: _Optional[int] = ...) -> None: ...

class PurgeSpec(_message.Message):
    __slots__ = ("namespaces", "roots", "stored_before", "everything")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    ROOTS_FIELD_NUMBER: _ClassVar[int]
    STORED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    EVERYTHING_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedScalarFieldContainer[bytes]
    roots: _containers.RepeatedScalarFieldContainer[bytes]
    stored_before: float
    everything: bool
    def __init__(self, namespaces: _Optional[_Iterable[bytes]] = ..., roots: _Optional[_Iterable[bytes]] = ..., stored_before: _Optional[float] = ..., everything: _Optional[bool] = ...) -> None: ...

class PurgeRequest(_message.Message):
    __slots__ = ("spec", "tenant", "wait_s")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    spec: PurgeSpec
    tenant: str
    wait_s: float
    def __init__(self, spec: _Optional[_Union[PurgeSpec, _Mapping]] = ..., tenant: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class PurgedTier(_message.Message):
    __slots__ = ("name", "chunks", "bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    chunks: int
    bytes: int
    def __init__(self, name: _Optional[str] = ..., chunks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class PurgeReply(_message.Message):
    __slots__ = ("tiers", "seq", "engines_applied", "engines_pending")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ENGINES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    ENGINES_PENDING_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[PurgedTier]
    seq: int
    engines_applied: int
    engines_pending: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[PurgedTier, _Mapping]]] = ..., seq: _Optional[int] = ..., engines_applied: _Optional[int] = ..., engines_pending: _Optional[int] = ...) -> None: ...

class PurgesRequest(_message.Message):
    __slots__ = ("watcher", "namespaces", "applied", "instance")
    class AppliedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WATCHER_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    watcher: str
    namespaces: _containers.RepeatedScalarFieldContainer[bytes]
    applied: _containers.ScalarMap[str, int]
    instance: str
    def __init__(self, watcher: _Optional[str] = ..., namespaces: _Optional[_Iterable[bytes]] = ..., applied: _Optional[_Mapping[str, int]] = ..., instance: _Optional[str] = ...) -> None: ...

class LoggedPurge(_message.Message):
    __slots__ = ("seq", "spec", "issued_at", "tenant")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    spec: PurgeSpec
    issued_at: float
    tenant: str
    def __init__(self, seq: _Optional[int] = ..., spec: _Optional[_Union[PurgeSpec, _Mapping]] = ..., issued_at: _Optional[float] = ..., tenant: _Optional[str] = ...) -> None: ...

class PurgesReply(_message.Message):
    __slots__ = ("purges", "instance", "lost", "now", "complete_to")
    class CompleteToEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PURGES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_TO_FIELD_NUMBER: _ClassVar[int]
    purges: _containers.RepeatedCompositeFieldContainer[LoggedPurge]
    instance: str
    lost: bool
    now: float
    complete_to: _containers.ScalarMap[str, int]
    def __init__(self, purges: _Optional[_Iterable[_Union[LoggedPurge, _Mapping]]] = ..., instance: _Optional[str] = ..., lost: _Optional[bool] = ..., now: _Optional[float] = ..., complete_to: _Optional[_Mapping[str, int]] = ...) -> None: ...
