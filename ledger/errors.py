"""ConfigError: bad input, refused before anything is dispatched."""


class ConfigError(ValueError):
    """Bad input: the message names the field and the rule it breaks."""
