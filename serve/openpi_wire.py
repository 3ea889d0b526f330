"""openpi's WebSocket wire format: msgpack maps in which numpy arrays and scalars are tagged maps.

An array travels as ``{b"__ndarray__": True, b"data": raw bytes, b"dtype": dtype.str, b"shape": [...]}``
and a numpy scalar as ``{b"__npgeneric__": True, b"data": value, b"dtype": dtype.str}`` (the keys
are msgpack *bin* values). This is what ``openpi_client.msgpack_numpy`` reads and writes, so the
stock client talks to this server unchanged. Decoding is strict: object, void and complex dtypes,
and a data length that does not match dtype and shape, raise ``WireError`` naming the field.
"""

from __future__ import annotations

import math

import msgpack
import numpy as np

ARRAY_TAG, SCALAR_TAG = b"__ndarray__", b"__npgeneric__"
_REFUSED_KINDS = ("O", "V", "c")  # objects would need pickle; void/complex have no use in an observation


class WireError(ValueError):
    """A frame that is not a valid openpi message; the text says which part."""


def _encode(obj):
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in _REFUSED_KINDS:
        raise TypeError(f"cannot send a numpy value of dtype {obj.dtype}")
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        return {ARRAY_TAG: True, b"data": arr.tobytes(), b"dtype": arr.dtype.str, b"shape": list(arr.shape)}
    if isinstance(obj, np.generic):
        return {SCALAR_TAG: True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send a value of type {type(obj).__name__}")


def pack(message: dict) -> bytes:
    """One binary frame holding ``message`` (numpy values tagged as openpi does)."""
    return msgpack.packb(message, default=_encode, use_bin_type=True)


def _dtype(raw, field: str) -> np.dtype:
    try:
        dtype = np.dtype(raw.decode() if isinstance(raw, bytes) else raw)
    except (TypeError, ValueError, UnicodeDecodeError):
        raise WireError(f"{field}: dtype {raw!r} is not a numpy dtype string") from None
    if dtype.kind in _REFUSED_KINDS:
        raise WireError(f"{field}: dtype {dtype} is not allowed (numeric, bool or string dtypes only)")
    return dtype


def _decode(obj: dict):
    if obj.get(ARRAY_TAG) is True:
        dtype = _dtype(obj.get(b"dtype"), "ndarray")
        shape, data = obj.get(b"shape"), obj.get(b"data")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise WireError(f"ndarray: shape {shape!r} is not a list of non-negative integers")
        if not isinstance(data, bytes) or len(data) != math.prod(shape) * dtype.itemsize:
            size = len(data) if isinstance(data, bytes) else type(data).__name__
            raise WireError(f"ndarray: {size} data bytes do not fit dtype {dtype} and shape {list(shape)}")
        # a writable copy: the frame's bytes are read-only, and torch warns on read-only arrays
        return np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    if obj.get(SCALAR_TAG) is True:
        dtype = _dtype(obj.get(b"dtype"), "numpy scalar")
        try:
            return dtype.type(obj.get(b"data"))
        except (TypeError, ValueError, OverflowError):
            raise WireError(f"numpy scalar: {obj.get(b'data')!r} is not a {dtype}") from None
    return obj


def unpack(frame: bytes) -> dict:
    """The message in one binary frame; ``WireError`` for anything but a msgpack map with string keys."""
    try:
        message = msgpack.unpackb(frame, object_hook=_decode, raw=False, strict_map_key=False)
    except WireError:
        raise
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for corrupt input
        raise WireError(f"frame is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(message, dict):
        raise WireError(f"frame holds a {type(message).__name__}, expected a map (an observation dict)")
    bad = [k for k in message if not isinstance(k, str)]
    if bad:
        raise WireError(f"observation keys must be strings; got {bad[0]!r}")
    return message
