"""The write side: the DCP StorageWriter (writer), its results as columns (written), item-by-item writes for offline jobs (stream)."""
