"""io's root error, which every file of io/ may raise."""


class SafetensorsError(ValueError):
    """A safetensors checkpoint that cannot be read as it claims: a truncated or corrupt
    file, a header whose byte ranges overlap or run past the file, an index naming a
    missing shard or one outside its folder. The message names the file and tensor."""
