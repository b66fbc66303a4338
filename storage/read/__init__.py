"""The read side: the DCP StorageReader (reader), the commit file opened once (metadata), byte ranges to read (read_plan), whole-file reads, fetch, verify and hand over (delivery)."""
