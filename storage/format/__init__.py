"""The on-disk format, pure: the metadata document (document), its JSON fields, item table and checks, rows, checksum tiles, safe paths."""

from __future__ import annotations

from dcpbridge.storage.format.document import rows_document, sign_document

__all__ = ["rows_document", "sign_document"]
