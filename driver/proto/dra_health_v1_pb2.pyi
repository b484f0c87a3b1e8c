from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HealthStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UNKNOWN: _ClassVar[HealthStatus]
    HEALTHY: _ClassVar[HealthStatus]
    UNHEALTHY: _ClassVar[HealthStatus]
UNKNOWN: HealthStatus
HEALTHY: HealthStatus
UNHEALTHY: HealthStatus

class NodeWatchResourcesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeviceIdentifier(_message.Message):
    __slots__ = ("pool_name", "device_name")
    POOL_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    pool_name: str
    device_name: str
    def __init__(self, pool_name: _Optional[str] = ..., device_name: _Optional[str] = ...) -> None: ...

class DeviceHealth(_message.Message):
    __slots__ = ("device", "health", "last_updated_time", "health_check_timeout_seconds", "message")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    LAST_UPDATED_TIME_FIELD_NUMBER: _ClassVar[int]
    HEALTH_CHECK_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    device: DeviceIdentifier
    health: HealthStatus
    last_updated_time: int
    health_check_timeout_seconds: int
    message: str
    def __init__(self, device: _Optional[_Union[DeviceIdentifier, _Mapping]] = ..., health: _Optional[_Union[HealthStatus, str]] = ..., last_updated_time: _Optional[int] = ..., health_check_timeout_seconds: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class NodeWatchResourcesResponse(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceHealth]
    def __init__(self, devices: _Optional[_Iterable[_Union[DeviceHealth, _Mapping]]] = ...) -> None: ...
