"""Reading a cosyvoice.Request off the wire: bytes that do not parse (a string field that is not UTF-8, a cut or
foreign message) become a MalformedRequest that says why, answered INVALID_ARGUMENT by the servicer, where grpc's
own deserialization would answer INTERNAL and log a traceback."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from service.errors import InvalidInputError
from service.rpc import cosyvoice_pb2
from service.speech.request import decode_text

_RAW_PACKAGE = "cosyvoice_raw"


@dataclass(frozen=True)
class MalformedRequest:
    """What the servicer receives instead of a Request when the message bytes do not parse."""

    error: InvalidInputError


def parse_request(data: bytes) -> cosyvoice_pb2.Request | MalformedRequest:
    """The gRPC request deserializer: a Request, or a MalformedRequest naming the first field that is not UTF-8."""
    request = cosyvoice_pb2.Request()
    try:
        request.ParseFromString(data)
    except DecodeError:
        return MalformedRequest(_why_malformed(data))
    return request


def _why_malformed(data: bytes) -> InvalidInputError:
    """Parse again with every string field read as bytes, and decode them one by one to find the bad one."""
    raw = _raw_request_class()()
    try:
        raw.ParseFromString(data)
    except DecodeError:
        return InvalidInputError(f"the message is not a valid {cosyvoice_pb2.Request.DESCRIPTOR.full_name}")
    for path, value in _string_fields(raw, cosyvoice_pb2.Request.DESCRIPTOR, ""):
        try:
            decode_text(value, path, path)
        except InvalidInputError as e:
            return e
    return InvalidInputError(f"the message is not a valid {cosyvoice_pb2.Request.DESCRIPTOR.full_name}")


def _string_fields(raw: Message, descriptor: Descriptor, prefix: str) -> list[tuple[str, bytes]]:
    """(dotted field path, raw bytes) of every set field that is a string in the real message."""
    found: list[tuple[str, bytes]] = []
    for field, value in raw.ListFields():
        real = descriptor.fields_by_name[field.name]
        path = f"{prefix}{field.name}"
        if real.type == FieldDescriptor.TYPE_STRING:
            found.append((path, bytes(value)))
        elif real.type == FieldDescriptor.TYPE_MESSAGE:
            found.extend(_string_fields(value, real.message_type, path + "."))
    return found


@functools.cache
def _raw_request_class() -> type[Message]:
    """cosyvoice.Request's twin in which every string field is bytes (so invalid UTF-8 parses)."""
    proto = descriptor_pb2.FileDescriptorProto()
    cosyvoice_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = f"{_RAW_PACKAGE}.proto", _RAW_PACKAGE
    del proto.service[:]
    for message in proto.message_type:
        for field in message.field:
            if field.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(".cosyvoice.", f".{_RAW_PACKAGE}.")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    raw: type[Message] = message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_RAW_PACKAGE}.Request"))
    return raw
