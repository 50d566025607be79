"""The one table from error code to gRPC status (the HTTP table is service/api/errors.py STATUS)."""

from __future__ import annotations

import grpc

from service.errors import ErrorCode

# code -> gRPC status. Refusals a client may retry (capacity, loading, shutdown, a store) are UNAVAILABLE, the
# status gRPC clients retry; a caller over its rate limit is RESOURCE_EXHAUSTED. Both carry `retry-after` seconds
# in the trailing metadata.
GRPC_STATUS: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INVALID_INPUT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.INVALID_AUDIO: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.EMPTY_TEXT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNKNOWN_SPEAKER: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNSUPPORTED_FORMAT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.TEXT_TOO_LONG: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNKNOWN_MODEL: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.UNAUTHORIZED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.RATE_LIMITED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.OVERLOADED: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.NOT_READY: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.PAYLOAD_TOO_LARGE: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.REQUEST_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.UNSUPPORTED_CAPABILITY: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.VOICE_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.TOO_MANY_VOICES: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.STORE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.STORAGE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.BUNDLE_INVALID: grpc.StatusCode.INTERNAL,
    ErrorCode.ENGINE_FAILURE: grpc.StatusCode.INTERNAL,
}
