"""What reads cost on each kind of storage: the read plan's model for joining ranges."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LOCAL_READ_COSTS", "OBJECT_STORE_READ_COSTS", "ReadCosts"]


@dataclass(frozen=True, slots=True)
class ReadCosts:
    """What reading costs on one kind of storage: a price per request plus a price per byte
    (a storage backend states its own, ``Storage.read_costs``)."""

    request_seconds: float
    """One request: a syscall and its Python bookkeeping (local), a round trip (S3)."""
    byte_seconds: float
    """One more byte in a request."""
    max_request: int = 8 << 20
    """The largest request worth making (larger ones stop gaining and hold more memory)."""
    verify_slab: int = 0
    """Read a whole chunk larger than this in slabs of about this many bytes (whole rows of
    checksum tiles), each verified as it lands, while it is still in the CPU's cache; 0: in
    one request, verified after (where a request costs much, as on object stores)."""

    def __post_init__(self) -> None:
        if not (self.request_seconds >= 0 and self.byte_seconds > 0):
            raise ValueError(f"read costs must be >= 0 per request and > 0 per byte: {self}")

    def seconds(self, requests: int, nbytes: int) -> float:
        """What ``requests`` requests for ``nbytes`` bytes in all cost."""
        return requests * self.request_seconds + nbytes * self.byte_seconds

    @property
    def break_even_gap(self) -> int:
        """The gap whose reading costs as much as a request: closer ranges are cheaper joined."""
        return int(self.request_seconds / self.byte_seconds)


# Local disk, measured on these 2-core VMs: a preadv and its Python bookkeeping about 15-20 us
# per request; bytes at 2.6 GB/s cold, 10+ GB/s from the page cache (a blend of ~4 GB/s).
# Verifying 1 MiB slabs as they land (L2-sized): measured, 8 x 16 MiB float32 chunks from
# tmpfs, 231 ms against 319 ms reading each chunk whole and verifying it after (raw: 163 ms).
LOCAL_READ_COSTS = ReadCosts(
    request_seconds=20e-6, byte_seconds=0.25e-9, max_request=8 << 20, verify_slab=1 << 20
)
# Object stores: a GET on the local S3 server costs 2.8 ms plus ~0.97 ns a byte (measured:
# 64 KiB 3.3 ms, 1 MiB 3.8 ms, 4 MiB 6.2 ms, 16 MiB 19 ms).
OBJECT_STORE_READ_COSTS = ReadCosts(
    request_seconds=2.8e-3, byte_seconds=0.97e-9, max_request=16 << 20
)
