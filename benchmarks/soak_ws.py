"""The soak's OpenPI WebSocket sessions (``/v1/realtime/robot/openpi``, the embedded ``reach`` policy).

Each function runs one session and returns what the server should count for it in
``omnidit_ws_sessions_total`` as ``"outcome code"``, decided from what the client itself saw:

* ``valid``: the stock ``openpi_client`` ``WebsocketClientPolicy`` sends a few observations, checks the
  actions, and closes normally: ``disconnected 1000``;
* ``drop``: a raw socket does the handshake, reads the metadata, sends the first part of a binary frame
  (a header announcing more bytes than follow) and closes the TCP connection: ``disconnected 1005``
  (uvicorn reports a connection lost after the handshake without a close frame as 1005);
* ``bad``: a frame the policy server refuses (not msgpack, a text frame, an observation missing a key):
  the client reads the error text and the server's 1011 close: ``server_closed 1011``;
* ``garbage``: a frame that breaks the WebSocket protocol (a reserved opcode): the server's WebSocket
  layer closes with 1002 and the handler sees ``disconnected 1002``.
"""

from __future__ import annotations

import asyncio
import base64
import os
import struct

import numpy as np
import websockets
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy

PATH = "/v1/realtime/robot/openpi"
ROUTE = PATH


def observation(rng: np.random.Generator) -> dict:
    """A reach-task observation (one 64x64 camera, state of 4)."""
    return {"observation/image": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8),
            "observation/state": rng.normal(size=4).astype(np.float32), "prompt": "reach the red disc"}


def _ws_url(url: str, query: str) -> str:
    return f"{url}{PATH}?{query}".replace("http", "ws", 1)


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Api-Key {api_key}"} if api_key else {}


def valid(url: str, seed: int, frames: int, api_key: str | None = None) -> str:
    """Blocking (the stock client is synchronous): run it in a thread."""
    rng = np.random.default_rng(seed)
    policy = WebsocketClientPolicy(_ws_url(url, "model=reach&deadline_ms=60000"), api_key=api_key)
    try:
        for _ in range(frames):
            actions = policy.infer(observation(rng))["actions"]
            if actions.ndim != 2 or not np.isfinite(actions).all():
                raise RuntimeError(f"bad actions {actions.shape}")
    finally:
        policy._ws.close()  # the stock client has no close(); its connection closes with 1000
    return "disconnected 1000"


async def bad(url: str, choice: int, api_key: str | None = None) -> str:
    frame = [b"\xc1 not msgpack", "a text frame",
             msgpack_numpy.packb({"observation/state": np.zeros(4, np.float32), "prompt": "x"})][choice]
    async with websockets.connect(_ws_url(url, "model=reach"), max_size=None,
                                  additional_headers=_headers(api_key)) as ws:
        await ws.recv()  # the metadata
        await ws.send(frame)
        text = await ws.recv()
        if not isinstance(text, str):
            raise RuntimeError("expected the error text frame")
        try:
            await ws.recv()
        except websockets.ConnectionClosed as e:
            return f"server_closed {e.rcvd.code if e.rcvd else 'none'}"
    raise RuntimeError("the server did not close the socket")


async def _handshake(url: str, api_key: str | None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw WebSocket handshake and the metadata frame read, so the caller can write any bytes."""
    host, port = url.split("//", 1)[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    key = base64.b64encode(os.urandom(16)).decode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in _headers(api_key).items())
    writer.write(f"GET {PATH}?model=reach HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n{extra}"
                 f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 101"):
        raise RuntimeError(f"handshake refused: {head[:40]!r}")
    first, second = await reader.readexactly(2)
    size = second & 0x7F
    if size == 126:
        size = struct.unpack(">H", await reader.readexactly(2))[0]
    elif size == 127:
        size = struct.unpack(">Q", await reader.readexactly(8))[0]
    await reader.readexactly(size)
    return reader, writer


def _masked_header(opcode: int, size: int) -> bytes:
    """A final client frame's header (masked, as clients must) announcing ``size`` payload bytes."""
    if size < 126:
        head = struct.pack(">BB", 0x80 | opcode, 0x80 | size)
    elif size < 1 << 16:
        head = struct.pack(">BBH", 0x80 | opcode, 0x80 | 126, size)
    else:
        head = struct.pack(">BBQ", 0x80 | opcode, 0x80 | 127, size)
    return head + os.urandom(4)


async def drop(url: str, seed: int, api_key: str | None = None) -> str:
    payload = msgpack_numpy.packb(observation(np.random.default_rng(seed)))
    reader, writer = await _handshake(url, api_key)
    writer.write(_masked_header(0x2, len(payload)) + payload[: len(payload) // 2])  # half a frame
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    return "disconnected 1005"


async def garbage(url: str, api_key: str | None = None) -> str:
    reader, writer = await _handshake(url, api_key)
    writer.write(_masked_header(0x3, 4) + b"oops")  # opcode 3 is reserved: a protocol error
    await writer.drain()
    try:
        data = await asyncio.wait_for(reader.read(64), 30)  # the server's close frame, then EOF
    finally:
        writer.close()
    code = struct.unpack(">H", data[2:4])[0] if len(data) >= 4 and data[0] & 0x0F == 0x8 else "none"
    return f"disconnected {code}"
