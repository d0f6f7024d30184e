"""The trainer's configuration: the schema (one dataclass per section, each checking its own
values), the keys a user may write, every cross-field rule once (`rules`) and Hydra's
composition. Pure: the checks that read files are the preflight's (`trainer.preflight`).
"""
