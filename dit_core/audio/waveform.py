"""Waveforms and their encodings.

A ``Waveform`` is float32 samples ``[channels, samples]`` in [-1, 1] plus a sample rate. It
encodes to WAV, FLAC, MP3, Ogg/Opus (all through soundfile, whose wheel ships libsndfile with
LAME and libopus: no system library is needed) and raw PCM (16-bit little-endian, interleaved).
Opus only takes 8/12/16/24/48 kHz: other rates are resampled to the next supported one (48 kHz
for 44.1 kHz audio). ``StreamEncoder`` turns successive chunks into bytes as they come, so that
the concatenated pieces form one valid stream.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# format -> (soundfile format, subtype, content type)
FORMATS = {
    "wav": ("WAV", "PCM_16", "audio/wav"),
    "flac": ("FLAC", "PCM_16", "audio/flac"),
    "mp3": ("MP3", "MPEG_LAYER_III", "audio/mpeg"),
    "opus": ("OGG", "OPUS", "audio/ogg"),
    "pcm": (None, None, "audio/pcm"),
}
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302  # libsndfile >= 1.2 (the one soundfile's wheel ships)
OGG_PAGE_MS = 20.0
SFC_SET_BITRATE_MODE, SF_BITRATE_MODE_CONSTANT = 0x1305, 0


@dataclass
class Waveform:
    """Float32 samples ``[channels, samples]`` at ``sample_rate`` Hz."""

    samples: np.ndarray
    sample_rate: int

    def __post_init__(self):
        samples = np.asarray(self.samples, dtype=np.float32)
        self.samples = samples[None] if samples.ndim == 1 else samples

    @property
    def channels(self) -> int:
        return self.samples.shape[0]

    def encode(self, fmt: str = "wav") -> bytes:
        return encode(self, fmt)

    def save(self, path: str | Path) -> Path:
        """Write to ``path``; the format follows the suffix (.wav, .flac, .mp3, .opus/.ogg, .pcm)."""
        path = Path(path)
        suffix = path.suffix.lower().lstrip(".")
        fmt = {"ogg": "opus"}.get(suffix, suffix)
        if fmt not in FORMATS:
            raise ValueError(f"cannot write {path}: use one of the suffixes {sorted(FORMATS)}")
        path.write_bytes(self.encode(fmt))
        return path


def content_type(fmt: str) -> str:
    return FORMATS[fmt][2]


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown audio format {fmt!r}; supported: {sorted(FORMATS)}")


def encode(wave: Waveform, fmt: str) -> bytes:
    """The whole waveform as one file of format ``fmt``."""
    enc = StreamEncoder(fmt, wave.sample_rate, wave.channels)
    streamed = enc.write(wave.samples) + enc.close()
    # a file, unlike a stream, keeps what the encoder filled in at the end (lengths in the header)
    return enc.final if enc.final is not None else streamed


def pcm16(samples: np.ndarray) -> bytes:
    """[channels, samples] float -> interleaved 16-bit little-endian PCM."""
    clipped = np.clip(samples, -1.0, 1.0)
    return (clipped.T * 32767.0).round().astype("<i2").tobytes()


def wav_stream_header(sample_rate: int, channels: int) -> bytes:
    """A WAV header for a stream of unknown length (RIFF and data sizes 0xFFFFFFFF), as streaming
    servers send; readers take the data to the end of the stream."""
    block = 2 * channels
    fmt = struct.pack("<HHIIHH", 1, channels, sample_rate, sample_rate * block, block, 16)
    return b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack("<I", 16) + fmt + b"data" + \
        struct.pack("<I", 0xFFFFFFFF)


class _Sink(io.RawIOBase):
    """A seekable in-memory file that remembers how much of it was already handed out: bytes the
    encoder rewrites after they were sent (a header it fills in at the end) stay as sent."""

    def __init__(self):
        super().__init__()
        self.data = bytearray()
        self.pos = 0
        self.sent = 0

    def writable(self):
        return True

    def seekable(self):
        return True

    def readable(self):
        return False

    def write(self, b) -> int:
        b = bytes(b)
        self.data[self.pos:self.pos + len(b)] = b
        self.pos += len(b)
        return len(b)

    def seek(self, offset, whence=0):
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else len(self.data) + offset
        return self.pos

    def tell(self):
        return self.pos

    def take(self) -> bytes:
        out = bytes(self.data[self.sent:])
        self.sent = len(self.data)
        return out


class StreamEncoder:
    """Encode successive chunks of one stream: ``write(chunk)`` returns the bytes ready so far,
    ``close()`` the rest. Concatenated, they are one valid file of the format."""

    def __init__(self, fmt: str, sample_rate: int, channels: int):
        check_format(fmt)
        self.fmt, self.channels = fmt, channels
        self.in_rate = sample_rate
        self.rate = sample_rate
        if fmt == "opus" and sample_rate not in OPUS_RATES:
            self.rate = next((r for r in OPUS_RATES if r >= sample_rate), OPUS_RATES[-1])
        self._header = wav_stream_header(sample_rate, channels) if fmt == "wav" else b""
        self._file = None
        self.final: bytes | None = None  # after close: the whole file as the encoder left it
        if FORMATS[fmt][0] is not None and fmt != "wav":
            import soundfile as sf

            self._sink = _Sink()
            self._file = sf.SoundFile(self._sink, "w", samplerate=self.rate, channels=channels,
                                      format=FORMATS[fmt][0], subtype=FORMATS[fmt][1])
            if fmt == "opus":  # flush an Ogg page every 20 ms of audio, not every ~1 s (libsndfile's default)
                latency = sf._ffi.new("double*", OGG_PAGE_MS)
                sf._snd.sf_command(self._file._file, SFC_SET_OGG_PAGE_LATENCY_MS, latency, sf._ffi.sizeof("double"))
            if fmt == "mp3":  # constant bit rate: without a Xing frame, readers size a stream by its bit rate
                mode = sf._ffi.new("int*", SF_BITRATE_MODE_CONSTANT)
                sf._snd.sf_command(self._file._file, SFC_SET_BITRATE_MODE, mode, sf._ffi.sizeof("int"))
        self._first = fmt == "mp3"  # the first MP3 bytes carry a Xing/Info frame to drop from a stream

    def write(self, samples: np.ndarray) -> bytes:
        samples = np.asarray(samples, dtype=np.float32)
        samples = samples[None] if samples.ndim == 1 else samples
        if samples.shape[0] != self.channels:
            raise ValueError(f"expected {self.channels} channels, got {samples.shape[0]}")
        head, self._header = self._header, b""
        if self._file is None:
            return head + pcm16(samples)
        if self.rate != self.in_rate:
            samples = _resample(samples, self.in_rate, self.rate)
        self._file.write(np.clip(samples, -1.0, 1.0).T)
        return head + self._take()

    def _take(self) -> bytes:
        out = self._sink.take()
        if self._first and out:
            # The encoder writes a Xing/Info frame first and fills in its frame count at the end; a
            # stream cannot wait for that, and decoders trust a stale count, so the stream goes without.
            self._first = False
            out = out[_xing_frame_length(out):]
        return out

    def close(self) -> bytes:
        head, self._header = self._header, b""
        if self._file is None:
            return head
        self._file.close()
        self.final = bytes(self._sink.data)
        return head + self._take()


def _resample(samples: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Polyphase resampling (per chunk: fine for the small ratio changes used here)."""
    from math import gcd

    from scipy.signal import resample_poly

    g = gcd(rate_in, rate_out)
    return resample_poly(samples, rate_out // g, rate_in // g, axis=-1).astype(np.float32)


_MP3_BITRATES = {  # kbit/s by (MPEG-1?, index), layer III
    True: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    False: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def _xing_frame_length(data: bytes) -> int:
    """Length of a leading MP3 Xing/Info frame, or of its blank placeholder, in ``data`` (after any
    ID3v2 tag), else 0."""
    start = 0
    if data[:3] == b"ID3" and len(data) >= 10:
        start = 10 + ((data[6] & 0x7F) << 21 | (data[7] & 0x7F) << 14 | (data[8] & 0x7F) << 7 | (data[9] & 0x7F))
    head = data[start:start + 4]
    if len(head) < 4 or head[0] != 0xFF or head[1] & 0xE0 != 0xE0:
        return 0
    version = (head[1] >> 3) & 3
    mpeg1 = version == 3
    bitrate = _MP3_BITRATES[mpeg1][head[2] >> 4] * 1000
    rate = _MP3_RATES.get(version, (0, 0, 0))[(head[2] >> 2) & 3] if (head[2] >> 2) & 3 < 3 else 0
    if not bitrate or not rate:
        return 0
    length = (144 if mpeg1 else 72) * bitrate // rate + ((head[2] >> 1) & 1)
    frame = data[start:start + length]
    # the encoder first writes the frame blank (zeros after the header) and the tag at the end
    if b"Xing" not in frame and b"Info" not in frame and any(frame[4:]):
        return 0
    return start + length
