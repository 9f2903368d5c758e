"""trunk.proto's messages on the hot path, written and read without copying tensor bytes.

A request or reply is a few bytes of header around large byte fields (a tensor's
``data``, and for compressed tensors ``indices``, ``mask`` and ``scales``). The
generated protobuf classes copy such a field at every step: into the message,
into its parent, out to the wire, and out of a parsed message again on each read
(for an 8 MiB batch about 4.5 ms of copies each way, more than the transport's
own). A :class:`Frame` is the same message held in Python. Its bytes fields are
references to buffers: a tensor's own memory when writing, slices of the received
frame when reading. Writing joins everything into the frame in one copy.

The bytes are protobuf's, field for field and byte for byte (the tests compare
both ways against the generated code, and fuzz the reader against protobuf's
parser). So ``trunk.proto`` stays the whole contract, and a native client keeps
using protoc's classes. Messages without bytes fields (``Metrics``, ``Ack``,
``Refusal``) stay generated messages inside a frame.

A frame reads like a generated message: fields by name (unset ones give
proto3's defaults), ``HasField``, ``WhichOneof``, ``SerializeToString``. So the
code that checks requests takes either.
"""

from __future__ import annotations

import operator
import struct
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from splitlearn.dataplane import trunk_pb2 as pb

Buffer = bytes | bytearray | memoryview

_VARINT, _I64, _LEN, _SGROUP, _EGROUP, _I32 = 0, 1, 2, 3, 4, 5
_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
#: protobuf's own nesting limit (only unknown groups can nest here).
_MAX_DEPTH = 100
_DOUBLE = struct.Struct("<d")
_EMPTY = memoryview(b"")
_ZERO_DOUBLE = bytes(8)
_UNSET = object()


#: Fields (and packed entries) a frame may hold, read or skipped: a real request has a few
#: dozen. The reader does constant work per field, so this bounds a frame's decoding in
#: time as well as size; a frame beyond it is refused before more is read.
MAX_FRAME_FIELDS = 4096


#: Below this size a frame is read by protobuf's C parser instead: its copies of a small
#: frame cost less than reading fields in Python (a 32 KiB request: about 1 us against
#: 15 us; the copies of an 8 MiB one: about 2 ms against none).
SMALL_FRAME_BYTES = 64 * 1024


class FrameDecodeError(ValueError):
    """The bytes are not an encoding of the message (protobuf's parser refuses them too).

    Or they hold more than :data:`MAX_FRAME_FIELDS` fields, which only the frame reader
    refuses (protobuf would read them, in time linear in their number).
    """


class _Budget:
    """Fields a frame's reader may still visit (see :data:`MAX_FRAME_FIELDS`)."""

    __slots__ = ("left",)

    def __init__(self, fields: int) -> None:
        self.left = fields

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise FrameDecodeError(f"more than {MAX_FRAME_FIELDS} fields in one frame")


def _int32(value: int) -> int:
    value &= _MASK32
    return value - (1 << 32) if value >> 31 else value


#: The scalar types a frame carries: wire type, decoding of the wire value.
_SCALARS: dict[int, tuple[int, Any]] = {
    FieldDescriptor.TYPE_UINT64: (_VARINT, lambda v: v & _MASK64),
    FieldDescriptor.TYPE_UINT32: (_VARINT, lambda v: v & _MASK32),
    FieldDescriptor.TYPE_BOOL: (_VARINT, bool),
    FieldDescriptor.TYPE_ENUM: (_VARINT, _int32),
    FieldDescriptor.TYPE_DOUBLE: (_I64, None),
}
_UNSIGNED_BITS = {FieldDescriptor.TYPE_UINT64: 64, FieldDescriptor.TYPE_UINT32: 32}

_holds: dict[str, bool] = {}


def holds_buffers(descriptor: Descriptor) -> bool:
    """Whether a message has a bytes field, itself or in a message field (then it is a Frame)."""
    name = descriptor.full_name
    if name not in _holds:
        _holds[name] = False  # a cycle ends here
        _holds[name] = any(
            f.type == FieldDescriptor.TYPE_BYTES
            or (f.message_type is not None and holds_buffers(f.message_type))
            for f in descriptor.fields
        )
    return _holds[name]


def _check_schema(descriptor: Descriptor) -> None:
    """Refuse, at import, a contract with a field this module cannot read or write."""
    for field in descriptor.fields:
        repeated = field.is_repeated
        if field.message_type is not None:
            if repeated:
                raise TypeError(f"{field.full_name}: repeated messages are not framed")
            if holds_buffers(field.message_type):
                _check_schema(field.message_type)
        elif field.type == FieldDescriptor.TYPE_BYTES:
            if repeated:
                raise TypeError(f"{field.full_name}: repeated bytes are not framed")
        elif field.type not in _SCALARS or (repeated and _SCALARS[field.type][0] != _VARINT):
            raise TypeError(f"{field.full_name}: type {field.type} is not framed")


for _root in (pb.Request, pb.Reply):
    _check_schema(_root.DESCRIPTOR)

#: Field kinds, as the reader and writer dispatch on them.
_FRAME, _MESSAGE, _BYTES, _REPEATED, _DOUBLE_KIND, _VARINT_KIND = range(6)


class _Field:
    """One field of a framed message, with what reading and writing it needs precomputed."""

    __slots__ = ("decode", "field", "kind", "name", "number", "oneof", "sub", "tag", "wire")

    def __init__(self, field: FieldDescriptor) -> None:
        self.field = field
        self.name = field.name
        self.number = field.number
        self.oneof = field.containing_oneof.name if field.containing_oneof else None
        self.sub: _Schema | type[Message] | None = None
        self.decode = None
        if field.message_type is not None:
            framed = holds_buffers(field.message_type)
            self.kind = _FRAME if framed else _MESSAGE
            sub = field.message_type
            self.sub = schema(sub) if framed else getattr(pb, sub.name)
            self.wire = _LEN
        elif field.type == FieldDescriptor.TYPE_BYTES:
            self.kind, self.wire = _BYTES, _LEN
        else:
            self.wire, self.decode = _SCALARS[field.type]
            if field.is_repeated:
                self.kind = _REPEATED
            else:
                self.kind = _DOUBLE_KIND if self.wire == _I64 else _VARINT_KIND
        self.tag = _varint(self.number << 3 | (_LEN if self.kind == _REPEATED else self.wire))

    def default(self) -> object:
        """proto3's value of the field when it is not set."""
        if self.kind == _REPEATED:
            return ()
        if self.kind == _FRAME:
            return Frame(self.sub.cls)  # type: ignore[union-attr]
        if self.kind == _MESSAGE:
            return self.sub()  # type: ignore[operator]
        if self.kind == _BYTES:
            return _EMPTY
        return self.field.default_value


class _Schema:
    """A framed message type: its fields by name and number, in wire order."""

    __slots__ = ("by_name", "by_number", "cls", "desc", "fields", "oneofs")

    def __init__(self, descriptor: Descriptor) -> None:
        self.desc = descriptor
        self.cls: type[Message] = getattr(pb, descriptor.name)
        self.fields: list[_Field] = []
        self.by_name: dict[str, _Field] = {}
        self.by_number: dict[int, _Field] = {}
        self.oneofs = frozenset(descriptor.oneofs_by_name)

    def build(self) -> _Schema:
        for field in sorted(self.desc.fields, key=operator.attrgetter("number")):
            compiled = _Field(field)
            self.fields.append(compiled)
            self.by_name[compiled.name] = compiled
            self.by_number[compiled.number] = compiled
        return self


_schemas: dict[str, _Schema] = {}


def schema(descriptor: Descriptor) -> _Schema:
    """Return the compiled schema of a framed message type (built once)."""
    compiled = _schemas.get(descriptor.full_name)
    if compiled is None:
        compiled = _schemas[descriptor.full_name] = _Schema(descriptor)
        compiled.build()
    return compiled


class Frame:
    """A trunk.proto message whose bytes fields are buffers, not copies.

    Parameters
    ----------
    cls : type[Message]
        The generated class this frame stands for (one that :func:`holds_buffers`).
    **fields
        Initial fields, as for the generated constructor; a message field also
        takes a dict of its own fields, and a bytes field any contiguous buffer
        (a NumPy array is sent as its raw bytes).
    """

    __slots__ = ("_oneofs", "_schema", "_values")

    def __init__(self, cls: type[Message], **fields: object) -> None:
        if not holds_buffers(cls.DESCRIPTOR):
            raise TypeError(f"{cls.DESCRIPTOR.name} has no bytes fields: use the generated class")
        object.__setattr__(self, "_schema", schema(cls.DESCRIPTOR))
        object.__setattr__(self, "_values", {})
        object.__setattr__(self, "_oneofs", {})
        for name, value in fields.items():
            setattr(self, name, value)

    @classmethod
    def unchecked(cls, message: type[Message], **fields: object) -> Frame:
        """Build a frame from values already in their wire form, skipping the setters' checks.

        For the hot path (the codec's own tensors and replies): bytes fields must be
        flat buffers (``bytes`` or a ``memoryview`` of bytes), repeated fields tuples
        of ints, scalars of their field's type and range, and message fields frames
        or generated messages of the right type.
        """
        compiled = schema(message.DESCRIPTOR)
        frame = cls._empty(compiled)
        by_name = compiled.by_name
        for name, value in fields.items():
            frame._set(by_name[name], value)
        return frame

    @classmethod
    def _empty(cls, compiled: _Schema) -> Frame:
        frame = object.__new__(cls)
        object.__setattr__(frame, "_schema", compiled)
        object.__setattr__(frame, "_values", {})
        object.__setattr__(frame, "_oneofs", {})
        return frame

    # --- reading like a generated message ----------------------------------------

    def __getattr__(self, name: str) -> Any:
        value = self._values.get(name, _UNSET)
        if value is not _UNSET:
            return value
        field = self._schema.by_name.get(name)
        if field is None:
            raise AttributeError(f"{self._schema.desc.name} has no field {name!r}")
        return field.default()

    def __setattr__(self, name: str, value: object) -> None:
        field = self._schema.by_name.get(name)
        if field is None:
            raise AttributeError(f"{self._schema.desc.name} has no field {name!r}")
        self._set(field, _coerce(field, value))

    def _set(self, field: _Field, value: object) -> None:
        if field.oneof is not None:
            previous = self._oneofs.get(field.oneof)
            if previous is not None and previous != field.name:
                del self._values[previous]
            self._oneofs[field.oneof] = field.name
        self._values[field.name] = value

    def HasField(self, name: str) -> bool:  # noqa: N802 - protobuf's name
        """Whether a message field (or a oneof member) was set."""
        field = self._schema.by_name.get(name)
        if field is None or (field.kind not in (_FRAME, _MESSAGE) and field.oneof is None):
            raise ValueError(f"{self._schema.desc.name}.{name} has no presence")
        return name in self._values

    def WhichOneof(self, name: str) -> str | None:  # noqa: N802 - protobuf's name
        """Return the member of oneof ``name`` that is set, or None."""
        if name not in self._schema.oneofs:
            raise ValueError(f"{self._schema.desc.name} has no oneof {name!r}")
        return self._oneofs.get(name)

    def __repr__(self) -> str:
        return f"Frame({self._schema.desc.name}, {sorted(self._values)})"

    # --- writing -------------------------------------------------------------------

    def SerializeToString(self) -> bytes:  # noqa: N802 - protobuf's name
        """Return the message's protobuf encoding; every buffer is copied once, into it."""
        pieces: list[Buffer] = []
        self._write(pieces)
        return b"".join(pieces)

    def ByteSize(self) -> int:  # noqa: N802 - protobuf's name
        """Length of :meth:`SerializeToString` (without building it)."""
        return self._write([])

    def to_proto(self) -> Message:
        """Return the generated message with the same fields (copies every buffer)."""
        return self._schema.cls(**self.as_fields())

    def as_fields(self) -> dict[str, object]:
        """Return the set fields as a generated constructor takes them (nested dicts, bytes)."""
        return {name: value.as_fields() if isinstance(value, Frame)
                else bytes(value) if isinstance(value, memoryview) else value
                for name, value in self._values.items()}

    @property
    def buffer_bytes(self) -> int:
        """Bytes held in this message's own bytes fields (not in its message fields)."""
        return sum(len(v) for v in self._values.values() if isinstance(v, memoryview | bytes))

    def _write(self, out: list[Buffer]) -> int:
        size = 0
        values = self._values
        for field in self._schema.fields:
            if field.name not in values:
                continue
            value = values[field.name]
            kind = field.kind
            if kind == _FRAME:
                at = len(out)
                out += (field.tag, b"")
                length = value._write(out)
                out[at + 1] = head = _varint(length)
                size += len(field.tag) + len(head) + length
                continue
            if kind == _MESSAGE:
                body = value.SerializeToString()
            elif kind == _BYTES:
                if not len(value) and field.oneof is None:
                    continue
                body = value
            elif kind == _REPEATED:
                if not value:
                    continue
                body = b"".join([_varint(v & _MASK64) for v in value])
            elif kind == _DOUBLE_KIND:
                encoded = _DOUBLE.pack(value)
                if encoded == _ZERO_DOUBLE and field.oneof is None:
                    continue  # proto3 leaves out zero bits (-0.0 is sent)
                out += (field.tag, encoded)
                size += len(field.tag) + 8
                continue
            else:
                if not value and field.oneof is None:
                    continue
                encoded = _varint(int(value) & _MASK64)
                out += (field.tag, encoded)
                size += len(field.tag) + len(encoded)
                continue
            head = _varint(len(body))
            out += (field.tag, head, body)
            size += len(field.tag) + len(head) + len(body)
        return size

    # --- reading -------------------------------------------------------------------

    @classmethod
    def parse(cls, message: type[Message], data: Buffer) -> Frame:
        """Read ``data`` as a ``message``; bytes fields are slices of ``data``, not copies.

        Raises
        ------
        FrameDecodeError
            Where protobuf's parser would refuse the bytes.
        """
        view = flat_bytes(data, "data")
        frame = cls._empty(schema(message.DESCRIPTOR))
        frame._read(view, 0, len(view), 0, _Budget(MAX_FRAME_FIELDS))
        frame._freeze()
        return frame

    def _freeze(self) -> None:
        """Turn the lists repeated fields were read into into tuples, here and below."""
        for name, value in self._values.items():
            if type(value) is list:
                self._values[name] = tuple(value)
            elif type(value) is Frame:
                value._freeze()

    def _repeated(self, field: _Field) -> list[int]:
        """Return the list a repeated field is read into (one, however often it recurs)."""
        values = self._values.get(field.name)
        if type(values) is not list:
            values = list(values or ())
            self._set(field, values)
        return values  # type: ignore[return-value]

    def _read(self, buf: memoryview, pos: int, end: int, depth: int, budget: _Budget) -> None:
        by_number = self._schema.by_number
        while pos < end:
            budget.spend()
            tag = buf[pos]
            if tag < 0x80:
                pos += 1
            else:
                tag, pos = _read_tag(buf, pos, end)
            number, wire_type = tag >> 3, tag & 7
            if not number:
                raise FrameDecodeError("field number 0")
            field = by_number.get(number)
            if field is None or not (wire_type == field.wire or (
                    field.kind == _REPEATED and wire_type == _LEN)):
                # An unknown field, or a known one with another wire type, is skipped,
                # as protobuf does (it keeps them as unknown fields; nothing here reads
                # those).
                pos = _skip(buf, pos, end, wire_type, number, depth, budget)
                continue
            if wire_type == _LEN:
                length, pos = _read_varint(buf, pos, end)
                stop = pos + length
                if stop > end:
                    raise FrameDecodeError(f"field {number} runs past the end of its message")
                self._take_span(field, buf, pos, stop, depth + 1, budget)
                pos = stop
            elif wire_type == _I64:
                if pos + 8 > end:
                    raise FrameDecodeError(f"field {number} runs past the end of its message")
                self._set(field, _DOUBLE.unpack_from(buf, pos)[0])
                pos += 8
            else:
                value, pos = _read_varint(buf, pos, end)
                if field.kind == _REPEATED:
                    self._repeated(field).append(field.decode(value))
                else:
                    self._set(field, field.decode(value))

    def _take_span(self, field: _Field, buf: memoryview, start: int, stop: int, depth: int,
                   budget: _Budget) -> None:
        kind = field.kind
        if kind == _BYTES:
            self._set(field, buf[start:stop])
        elif kind == _FRAME:
            # A message field seen again is merged into the first, as protobuf does.
            sub = self._values.get(field.name)
            if sub is None:
                sub = Frame._empty(field.sub)  # type: ignore[arg-type]
            sub._read(buf, start, stop, depth, budget)
            self._set(field, sub)
        elif kind == _MESSAGE:
            sub = self._values.get(field.name)
            if sub is None:
                sub = field.sub()  # type: ignore[operator]
            _walk(buf, start, stop, depth, budget)  # protobuf's nesting limit counts this level
            try:
                sub.MergeFromString(bytes(buf[start:stop]))
            except DecodeError as err:
                raise FrameDecodeError(f"{field.field.full_name}: {err}") from None
            self._set(field, sub)
        else:  # packed repeated
            values = self._repeated(field)
            decode = field.decode
            while start < stop:
                budget.spend()
                value, start = _read_varint(buf, start, stop)
                values.append(decode(value))


def read(message: type[Message], data: bytes) -> Frame | Message:
    """Read a received frame: by protobuf below :data:`SMALL_FRAME_BYTES`, else as a Frame.

    Either reads the same fields from the same bytes and refuses the same bytes
    (the tests hold the frame reader to protobuf's), so callers cannot tell.

    Raises
    ------
    FrameDecodeError
        If the bytes are not a ``message``.
    """
    if len(data) >= SMALL_FRAME_BYTES:
        return Frame.parse(message, data)
    try:
        return message.FromString(data)
    except DecodeError as err:
        raise FrameDecodeError(str(err)) from None


def _coerce(compiled: _Field, value: object) -> object:
    """Check and convert a value assigned to a field, as the generated setters would."""
    field = compiled.field
    if field.message_type is not None:
        return _coerce_message(field.message_type, value)
    if field.is_repeated:
        return tuple(_coerce_scalar(field, v) for v in value)  # type: ignore[attr-defined]
    if field.type == FieldDescriptor.TYPE_BYTES:
        return flat_bytes(value, field.name)  # type: ignore[arg-type]
    return _coerce_scalar(field, value)


def flat_bytes(value: Buffer, name: str = "buffer") -> memoryview:
    """``value``'s bytes as a flat memoryview (no copy)."""
    view = memoryview(value)
    if view.ndim == 1 and view.format == "B":
        return view
    if not view.c_contiguous:
        raise ValueError(f"{name}: a buffer must be contiguous")
    return view.cast("B") if view.nbytes else _EMPTY


def _coerce_message(descriptor: Descriptor, value: object) -> object:
    cls = getattr(pb, descriptor.name)
    if holds_buffers(descriptor):
        if isinstance(value, dict):
            return Frame(cls, **value)
        if isinstance(value, Frame) and value._schema.desc is descriptor:
            return value
        if isinstance(value, cls):
            return Frame.parse(cls, value.SerializeToString())
    elif isinstance(value, dict):
        return cls(**value)
    elif isinstance(value, cls):
        return value
    raise TypeError(f"expected a {descriptor.name}, got {type(value).__name__}")


def _coerce_scalar(field: FieldDescriptor, value: object) -> object:
    if field.type == FieldDescriptor.TYPE_DOUBLE:
        return float(value)  # type: ignore[arg-type]
    if field.type == FieldDescriptor.TYPE_BOOL:
        return bool(value)
    number = operator.index(value)  # type: ignore[arg-type]
    bits = _UNSIGNED_BITS.get(field.type)
    if bits is not None and not 0 <= number < 1 << bits:
        raise ValueError(f"{field.name}: {number} is outside uint{bits}")
    if bits is None and not -(1 << 31) <= number < 1 << 31:  # an enum is an int32
        raise ValueError(f"{field.name}: {number} is outside int32")
    return number


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise FrameDecodeError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _MASK64, pos
        shift += 7
        if shift >= 70:
            raise FrameDecodeError("varint longer than 10 bytes")


def _read_tag(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    """Read a field's tag: a varint of at most 5 bytes and 32 bits, as protobuf reads it.

    protobuf refuses a tag spelt in more bytes even when its value fits (``88 80 80 80
    80 00`` for field 1), so a frame must too.
    """
    tag, after = _read_varint(buf, pos, end)
    if after - pos > 5 or tag > _MASK32:
        raise FrameDecodeError(f"invalid tag {tag} ({after - pos} bytes)")
    return tag, after


def _skip(buf: memoryview, pos: int, end: int, wire_type: int, number: int, depth: int,
          budget: _Budget) -> int:
    """Return where the value of a field starting at ``pos`` ends, checking it is whole."""
    if wire_type == _VARINT:
        return _read_varint(buf, pos, end)[1]
    if wire_type in (_I64, _I32):
        stop = pos + (8 if wire_type == _I64 else 4)
    elif wire_type == _LEN:
        length, pos = _read_varint(buf, pos, end)
        stop = pos + length
    elif wire_type == _SGROUP:
        return _skip_group(buf, pos, end, number, depth + 1, budget)
    else:
        raise FrameDecodeError(f"field {number} has wire type {wire_type}")
    if stop > end:
        raise FrameDecodeError(f"field {number} runs past the end of its message")
    return stop


def _walk(buf: memoryview, pos: int, end: int, depth: int, budget: _Budget) -> None:
    """Check that ``buf[pos:end]`` is a sequence of whole fields within the nesting limit."""
    while pos < end:
        budget.spend()
        tag, pos = _read_tag(buf, pos, end)
        if not tag >> 3:
            raise FrameDecodeError(f"invalid tag {tag}")
        pos = _skip(buf, pos, end, tag & 7, tag >> 3, depth, budget)


def _skip_group(buf: memoryview, pos: int, end: int, number: int, depth: int,
                budget: _Budget) -> int:
    if depth > _MAX_DEPTH:
        raise FrameDecodeError("groups nested too deep")
    while True:
        budget.spend()
        tag, pos = _read_tag(buf, pos, end)
        if not tag >> 3:
            raise FrameDecodeError(f"invalid tag {tag}")
        if tag & 7 == _EGROUP:
            if tag >> 3 != number:
                raise FrameDecodeError(f"group {number} ended by {tag >> 3}")
            return pos
        pos = _skip(buf, pos, end, tag & 7, tag >> 3, depth, budget)
