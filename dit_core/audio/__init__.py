"""Audio outputs: waveforms, their encodings (whole and streamed), and the text-to-speech stage."""

from .waveform import FORMATS, StreamEncoder, Waveform, content_type, encode

__all__ = ["FORMATS", "StreamEncoder", "Waveform", "content_type", "encode"]
