from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT8: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
INT64: DType
INT8: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "scales", "row_nnz", "indices", "mask")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    ROW_NNZ_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    scales: bytes
    row_nnz: int
    indices: bytes
    mask: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., row_nnz: _Optional[int] = ..., indices: _Optional[bytes] = ..., mask: _Optional[bytes] = ...) -> None: ...

class Forward(_message.Message):
    __slots__ = ("activations", "labels", "example_ids", "feedback_version", "feedback_lineage")
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_VERSION_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_LINEAGE_FIELD_NUMBER: _ClassVar[int]
    activations: Tensor
    labels: Tensor
    example_ids: Tensor
    feedback_version: int
    feedback_lineage: int
    def __init__(self, activations: _Optional[_Union[Tensor, _Mapping]] = ..., labels: _Optional[_Union[Tensor, _Mapping]] = ..., example_ids: _Optional[_Union[Tensor, _Mapping]] = ..., feedback_version: _Optional[int] = ..., feedback_lineage: _Optional[int] = ...) -> None: ...

class Evaluate(_message.Message):
    __slots__ = ("activations", "labels")
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    activations: Tensor
    labels: Tensor
    def __init__(self, activations: _Optional[_Union[Tensor, _Mapping]] = ..., labels: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Backward(_message.Message):
    __slots__ = ("grad",)
    GRAD_FIELD_NUMBER: _ClassVar[int]
    grad: Tensor
    def __init__(self, grad: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Smashed(_message.Message):
    __slots__ = ("activations", "labels", "example_ids", "feedback_version", "feedback_lineage")
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_VERSION_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_LINEAGE_FIELD_NUMBER: _ClassVar[int]
    activations: Tensor
    labels: Tensor
    example_ids: Tensor
    feedback_version: int
    feedback_lineage: int
    def __init__(self, activations: _Optional[_Union[Tensor, _Mapping]] = ..., labels: _Optional[_Union[Tensor, _Mapping]] = ..., example_ids: _Optional[_Union[Tensor, _Mapping]] = ..., feedback_version: _Optional[int] = ..., feedback_lineage: _Optional[int] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("seq", "forward", "evaluate", "backward", "smashed")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIELD_NUMBER: _ClassVar[int]
    SMASHED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    forward: Forward
    evaluate: Evaluate
    backward: Backward
    smashed: Smashed
    def __init__(self, seq: _Optional[int] = ..., forward: _Optional[_Union[Forward, _Mapping]] = ..., evaluate: _Optional[_Union[Evaluate, _Mapping]] = ..., backward: _Optional[_Union[Backward, _Mapping]] = ..., smashed: _Optional[_Union[Smashed, _Mapping]] = ...) -> None: ...

class Gradient(_message.Message):
    __slots__ = ("grad", "loss", "correct", "feedback_dropped")
    GRAD_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_DROPPED_FIELD_NUMBER: _ClassVar[int]
    grad: Tensor
    loss: float
    correct: int
    feedback_dropped: bool
    def __init__(self, grad: _Optional[_Union[Tensor, _Mapping]] = ..., loss: _Optional[float] = ..., correct: _Optional[int] = ..., feedback_dropped: _Optional[bool] = ...) -> None: ...

class Metrics(_message.Message):
    __slots__ = ("loss", "correct")
    LOSS_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    loss: float
    correct: int
    def __init__(self, loss: _Optional[float] = ..., correct: _Optional[int] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("features", "replaced_pending", "feedback_dropped")
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    REPLACED_PENDING_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_DROPPED_FIELD_NUMBER: _ClassVar[int]
    features: Tensor
    replaced_pending: bool
    feedback_dropped: bool
    def __init__(self, features: _Optional[_Union[Tensor, _Mapping]] = ..., replaced_pending: _Optional[bool] = ..., feedback_dropped: _Optional[bool] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("queued", "feedback_dropped")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_DROPPED_FIELD_NUMBER: _ClassVar[int]
    queued: int
    feedback_dropped: bool
    def __init__(self, queued: _Optional[int] = ..., feedback_dropped: _Optional[bool] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("reason", "detail")
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[Refusal.Reason]
        MALFORMED: _ClassVar[Refusal.Reason]
        TOO_LARGE: _ClassVar[Refusal.Reason]
        TOKEN_REJECTED: _ClassVar[Refusal.Reason]
        UNEXPECTED_KIND: _ClassVar[Refusal.Reason]
        BAD_TENSOR: _ClassVar[Refusal.Reason]
        NOT_FINITE: _ClassVar[Refusal.Reason]
        OUT_OF_RANGE: _ClassVar[Refusal.Reason]
        REPLAYED: _ClassVar[Refusal.Reason]
        NO_PENDING_FORWARD: _ClassVar[Refusal.Reason]
        STEP_NOT_FINITE: _ClassVar[Refusal.Reason]
        BUSY: _ClassVar[Refusal.Reason]
        INTERNAL: _ClassVar[Refusal.Reason]
        STALE_FEEDBACK: _ClassVar[Refusal.Reason]
        QUARANTINED: _ClassVar[Refusal.Reason]
    REASON_UNSPECIFIED: Refusal.Reason
    MALFORMED: Refusal.Reason
    TOO_LARGE: Refusal.Reason
    TOKEN_REJECTED: Refusal.Reason
    UNEXPECTED_KIND: Refusal.Reason
    BAD_TENSOR: Refusal.Reason
    NOT_FINITE: Refusal.Reason
    OUT_OF_RANGE: Refusal.Reason
    REPLAYED: Refusal.Reason
    NO_PENDING_FORWARD: Refusal.Reason
    STEP_NOT_FINITE: Refusal.Reason
    BUSY: Refusal.Reason
    INTERNAL: Refusal.Reason
    STALE_FEEDBACK: Refusal.Reason
    QUARANTINED: Refusal.Reason
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    reason: Refusal.Reason
    detail: str
    def __init__(self, reason: _Optional[_Union[Refusal.Reason, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class Reply(_message.Message):
    __slots__ = ("seq", "gradient", "metrics", "features", "ack", "refusal")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    seq: int
    gradient: Gradient
    metrics: Metrics
    features: Features
    ack: Ack
    refusal: Refusal
    def __init__(self, seq: _Optional[int] = ..., gradient: _Optional[_Union[Gradient, _Mapping]] = ..., metrics: _Optional[_Union[Metrics, _Mapping]] = ..., features: _Optional[_Union[Features, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., refusal: _Optional[_Union[Refusal, _Mapping]] = ...) -> None: ...
