"""Save and load: DCP's steps (drive) over failure-carrying collectives (protocol), who writes and reads what (ownership), fully-parallel hand-off, staging and async save."""
