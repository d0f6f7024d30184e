"""The trainer's configuration: the schema (one dataclass per section), the keys a user may
write, and the checks that run before any model loads (`preflight`)."""
