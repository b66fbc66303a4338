"""Save and load: the DCP-protocol engine, collectives, fully-parallel distribution, staging and async save."""
