"""The trainer's configuration, every check of it in this package: the schema (`schema`: one
dataclass per section, from `sections` and `loss_sections`, each checking its own values), the
keys a user may write (`keys`), every cross-field rule once (`rules`), Hydra's composition
(`compose`), and the checks that read files before any model loads (`preflight`). `checks`
holds the one `ConfigError` and the helpers that name the field."""
