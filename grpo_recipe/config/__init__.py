"""Configuration: the Config dataclass and the checks of each field (schema.py), YAML files and --key value
overrides (load.py), --help (help.py). A leaf: imports nothing else of the package."""
