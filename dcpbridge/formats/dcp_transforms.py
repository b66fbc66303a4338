"""Undoes DCP's stream extensions (``FileSystemWriter(_extensions=[ZStandard()])``) on stored bytes.

DCP records, per stored item, the descriptors of the transforms its bytes went through
(``_StorageInfo.transform_descriptors``, e.g. ``["stream.zstd/1"]``), in the order a reader
undoes them. dcpbridge decodes ``stream.zstd`` version 1 with the ``zstandard`` package;
anything else raises ``UnsupportedExtensionError`` naming the descriptor and the item.

Decoding is bounded: the caller says how many bytes the item may decode to (a tensor chunk's
``torch.save`` blob: its bytes plus framing; an object: ``object_limit``), compressed input
is fed in pieces sized so that no step outgrows that bound by more than 128 MiB,
and a frame that is cut short or followed by stray bytes is refused, never handed on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dcpbridge.errors import CorruptCheckpointError, UnsupportedExtensionError

ZSTD = "stream.zstd"
ZSTD_PACKAGE = "zstandard"
# A zstd block decodes to at most 128 KiB from at least 4 bytes: one input byte yields at
# most 32 KiB of output, so a piece of N input bytes overshoots a bound by < N * 32 KiB.
_RATIO = 1 << 15
_MIN_PIECE = 4 << 10  # so a bound is overshot by at most 128 MiB, in the last step
_MAX_PIECE = 4 << 20
# Framing ``torch.save`` adds to a tensor chunk's bytes (zip records, a small pickle).
TORCH_SAVE_SLACK = 1 << 20
_OBJECT_FLOOR = 256 << 20


def object_limit(stored: int) -> int:
    """The most bytes an object stored in ``stored`` transformed bytes may decode to: DCP
    records no size for objects, so 1024 times its stored size, at least 256 MiB."""
    return max(_OBJECT_FLOOR, stored * 1024)


def most_decoded(stored: int, stages: int) -> int:
    """The most bytes ``stored`` bytes can decode to through ``stages`` transforms: zstd's
    bound per stage (an extension dcpbridge cannot undo is refused when read)."""
    return stored * _RATIO**stages


def descriptors_of(info: Any, what: str) -> tuple[str, ...]:
    """The transform descriptors DCP recorded for an item (``()``: stored as is), checked."""
    found = getattr(info, "transform_descriptors", None)
    if not found:
        return ()
    if not isinstance(found, (list, tuple)) or not all(isinstance(d, str) for d in found):
        raise CorruptCheckpointError(
            f"{what}: transform_descriptors must be a list of strings, got {found!r:.200}"
        )
    return tuple(found)


def _zstd_module(descriptor: str, what: str) -> Any:
    try:
        import zstandard
    except ImportError as e:
        raise UnsupportedExtensionError(
            f"{what} is stored through DCP extension {descriptor!r} (ZStandard compression); "
            f"decoding it needs the {ZSTD_PACKAGE!r} package, which is not installed here "
            f"(pip install {ZSTD_PACKAGE})"
        ) from e
    return zstandard


def _decoder(descriptor: str, what: str) -> Any:
    """A fresh decompressor for ``descriptor`` (``decompress``, ``eof``, ``unused_data``)."""
    name, _, version = descriptor.partition("/")
    if name == ZSTD and version.partition(".")[0] == "1":
        return _zstd_module(descriptor, what).ZstdDecompressor().decompressobj()
    raise UnsupportedExtensionError(
        f"{what} is stored through DCP extension {descriptor!r:.200}, which dcpbridge cannot "
        f"decode (it reads {ZSTD}/1, ZStandard compression, only)"
    )


def _undo(descriptor: str, raw: bytes | memoryview, limit: int, what: str) -> bytes:
    decoder = _decoder(descriptor, what)
    data = memoryview(raw).cast("B")
    out = bytearray()
    at = 0
    try:
        while at < len(data) and not decoder.eof:
            piece = min(_MAX_PIECE, max(_MIN_PIECE, (limit - len(out)) // _RATIO))
            out += decoder.decompress(data[at : at + piece])
            at += piece
            if len(out) > limit:
                raise CorruptCheckpointError(
                    f"{what}: its {descriptor} stream decodes to more than the {limit} bytes "
                    "the item can hold"
                )
    except CorruptCheckpointError:
        raise
    except Exception as e:  # the decompressor's own error (zstandard.ZstdError)
        raise CorruptCheckpointError(f"{what}: {descriptor} stream does not decode: {e}") from e
    if not decoder.eof:
        raise CorruptCheckpointError(f"{what}: {descriptor} stream is cut short")
    if at < len(data) or decoder.unused_data:
        raise CorruptCheckpointError(
            f"{what}: stray bytes after the end of its {descriptor} stream"
        )
    return bytes(out)


def decode(
    raw: bytes | memoryview, descriptors: Sequence[str], *, limit: int, what: str
) -> bytes | memoryview:
    """``raw`` with DCP's transforms ``descriptors`` undone, in their recorded order; each
    stage may decode to at most ``limit`` bytes. ``what`` names the item in errors."""
    for descriptor in descriptors:
        raw = _undo(descriptor, raw, limit, what)
    return raw
