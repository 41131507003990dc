"""m3serve's Python client: Generate, Converse and the model's description in the
model's own terms (text, speech unit frames, named controls, raw ids).

The gRPC stubs (package m3serve_proto) are generated from proto/m3serve.proto by
clients/python/generate_stubs.sh."""

from .client import Chunk, Client, Finished, M3ServeError, ModelInfo, Sampling, Session, VocabLayout
from .segments import Control, Ids, Segment, Text, Units

__all__ = [
    "Chunk", "Client", "Control", "Finished", "Ids", "M3ServeError", "ModelInfo", "Sampling", "Segment",
    "Session", "Text", "Units", "VocabLayout",
]
