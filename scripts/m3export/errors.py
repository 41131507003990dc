"""The one error type of the exporter: a message that names the file and the tensor."""


class ExportError(Exception):
    """A checkpoint, config or argument the exporter refuses; the message says why."""
