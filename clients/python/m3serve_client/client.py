"""A typed wrapper over m3serve's gRPC API: Generate, Converse sessions and the model's
description, with TLS and API keys as options."""

from __future__ import annotations

import os
import queue
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import grpc

from m3serve_proto import m3serve_pb2 as pb
from m3serve_proto import m3serve_pb2_grpc as pb_grpc

from .segments import Segment, from_proto, to_proto

# What a prompt or a turn's input may be: text (needs the server's tokenizer), raw ids,
# or segments in the model's terms.
Prompt = Union[str, Sequence[int], Sequence[Segment]]

_ALLOWED = {
    "all": pb.ALLOWED_TOKENS_ALL,
    "text": pb.ALLOWED_TOKENS_TEXT,
    "text_and_controls": pb.ALLOWED_TOKENS_TEXT_AND_CONTROLS,
    "units": pb.ALLOWED_TOKENS_UNITS,
    "units_and_controls": pb.ALLOWED_TOKENS_UNITS_AND_CONTROLS,
}

_REASONS = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_END_OF_REPLY: "end_of_reply",
}


class M3ServeError(Exception):
    """A call the server (or gRPC) ended with an error status."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0        # 0: greedy
    top_k: int = 0                  # 0: no limit
    top_p: Optional[float] = None   # None: 1.0
    seed: Optional[int] = None      # None: the server draws one (Finished.seed says which)
    # Which ids a reply may hold: "all", "text", "text_and_controls", "units" (whole
    # frames in frame order), "units_and_controls". Anything but "all" needs a vocab.json.
    allowed: str = "all"

    def to_proto(self) -> pb.SamplingParams:
        if self.allowed not in _ALLOWED:
            raise ValueError(f"Sampling.allowed {self.allowed!r} is not one of {', '.join(_ALLOWED)}")
        p = pb.SamplingParams(temperature=self.temperature, top_k=self.top_k, allowed=_ALLOWED[self.allowed])
        if self.top_p is not None:
            p.top_p = self.top_p
        if self.seed is not None:
            p.seed = self.seed
        return p


@dataclass(frozen=True)
class Chunk:
    """Tokens made since the previous chunk: their ids, their text (with a tokenizer) and,
    with a vocabulary layout, the same as typed segments."""

    ids: Tuple[int, ...]
    text: str
    segments: Tuple[Segment, ...]


@dataclass(frozen=True)
class Finished:
    """The end of a reply: why ("length", "stop", "end_of_reply", "cancelled"), its
    counts and timings, the seed used."""

    reason: str
    prompt_tokens: int
    generated_tokens: int
    time_to_first_token_ms: float
    tokens_per_second: float
    seed: int
    turn: int = 0          # Converse: 0-based turn
    request_id: str = ""   # Generate


@dataclass(frozen=True)
class VocabLayout:
    text_size: int                  # text ids are [0, text_size); 0: no text
    tokenizer: str                  # the model directory's SentencePiece file, if any
    units_first_id: int
    codebooks: int                  # 0: no speech units
    units_per_codebook: int
    frame_order: Tuple[int, ...]
    controls: Dict[str, int]

    def unit_id(self, codebook: int, unit: int) -> int:
        return self.units_first_id + codebook * self.units_per_codebook + unit


@dataclass(frozen=True)
class ModelInfo:
    name: str
    backend: str
    vocab_size: int
    max_batch: int
    has_tokenizer: bool
    demo_model: bool
    vocab: Optional[VocabLayout]    # None: the model has no vocab.json (ids only)
    message: pb.ModelInfo = field(repr=False)  # everything the server said


def _vocab_of(info: pb.ModelInfo) -> Optional[VocabLayout]:
    if not info.HasField("vocab"):
        return None
    v = info.vocab
    return VocabLayout(
        text_size=v.text.size if v.HasField("text") else 0,
        tokenizer=v.text.tokenizer if v.HasField("text") else "",
        units_first_id=v.speech_units.first_id,
        codebooks=v.speech_units.codebooks if v.HasField("speech_units") else 0,
        units_per_codebook=v.speech_units.units_per_codebook,
        frame_order=tuple(v.speech_units.frame_order),
        controls={c.name: c.id for c in v.controls},
    )


def _read_ca(tls_ca: Union[str, bytes, os.PathLike]) -> bytes:
    if isinstance(tls_ca, bytes):
        return tls_ca
    try:
        with open(tls_ca, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"tls_ca {os.fspath(tls_ca)}: {e.strerror}") from None


class Client:
    """One channel to an m3serve.

    target: "host:port". tls_ca: a PEM file (path) or its bytes: TLS with that CA;
    tls=True without tls_ca: TLS with the system's roots. api_key: sent with every call
    as "authorization: Bearer KEY". timeout: seconds per call (None: no deadline).
    """

    def __init__(self, target: str, *, tls_ca: Union[str, bytes, os.PathLike, None] = None, tls: bool = False,
                 api_key: Optional[str] = None, timeout: Optional[float] = None,
                 options: Sequence[Tuple[str, object]] = ()):
        if tls_ca is not None or tls:
            creds = grpc.ssl_channel_credentials(root_certificates=_read_ca(tls_ca) if tls_ca is not None else None)
            self._channel = grpc.secure_channel(target, creds, options=list(options))
        else:
            self._channel = grpc.insecure_channel(target, options=list(options))
        self._stub = pb_grpc.M3ServeStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._timeout = timeout
        self._info: Optional[ModelInfo] = None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def model_info(self, *, wait_for_ready: bool = False) -> ModelInfo:
        try:
            m = self._stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self._metadata, timeout=self._timeout,
                                        wait_for_ready=wait_for_ready)
        except grpc.RpcError as e:
            raise M3ServeError(e.code(), e.details()) from None
        self._info = ModelInfo(name=m.model_name, backend=m.backend, vocab_size=m.vocab_size, max_batch=m.max_batch,
                               has_tokenizer=m.has_tokenizer, demo_model=m.demo_model, vocab=_vocab_of(m), message=m)
        return self._info

    def generate(self, prompt: Prompt, *, max_new_tokens: int, sampling: Sampling = Sampling(),
                 stop_token_ids: Sequence[int] = (), request_id: str = "") -> Iterator[Union[Chunk, Finished]]:
        """Streams the continuation of `prompt`: Chunks, then one Finished."""
        request = pb.GenerateRequest(request_id=request_id, max_new_tokens=max_new_tokens,
                                     sampling=sampling.to_proto(), stop_token_ids=list(stop_token_ids))
        kind, value = _prompt(prompt)
        if kind == "text":
            request.prompt_text = value
        elif kind == "ids":
            request.prompt_ids.ids.extend(value)
        else:
            request.prompt_segments.CopyFrom(value)
        codebooks = self._codebooks()
        try:
            for response in self._stub.Generate(request, metadata=self._metadata, timeout=self._timeout):
                if response.HasField("tokens"):
                    yield _chunk(response.tokens, codebooks)
                else:
                    f = response.finished
                    yield _finished(f, turn=0, request_id=f.request_id)
        except grpc.RpcError as e:
            raise M3ServeError(e.code(), e.details()) from None

    def converse(self, *, max_new_tokens: int = 0, sampling: Sampling = Sampling(),
                 stop_token_ids: Sequence[int] = (), session_id: str = "") -> "Session":
        """A speech-to-speech session: each turn() sends input and streams the reply."""
        config = pb.SessionConfig(session_id=session_id, max_new_tokens=max_new_tokens,
                                  sampling=sampling.to_proto(), stop_token_ids=list(stop_token_ids))
        return Session(self._stub, config, self._metadata, self._timeout, self._codebooks())

    def _codebooks(self) -> int:
        # Reply unit segments are split into frames by the model's codebook count.
        if self._info is None:
            self.model_info()
        return self._info.vocab.codebooks if self._info.vocab else 0


class Session:
    """A Converse stream. Iterate turn(...) to its Finished before the next turn;
    close() (or a with-block) ends the session."""

    _END = object()

    def __init__(self, stub, config: pb.SessionConfig, metadata, timeout, codebooks: int):
        self._requests: "queue.Queue[object]" = queue.Queue()
        self._requests.put(pb.ConverseRequest(config=config))
        self._codebooks = codebooks
        self._responses = stub.Converse(self._request_iterator(), metadata=metadata, timeout=timeout)
        self._closed = False

    def _request_iterator(self):
        while True:
            item = self._requests.get()
            if item is Session._END:
                return
            yield item

    def turn(self, input: Prompt, *, max_new_tokens: int = 0) -> Iterator[Union[Chunk, Finished]]:
        """Sends one client turn (then end_turn) and streams the reply: Chunks, then one
        Finished. max_new_tokens 0: the session's."""
        if self._closed:
            raise ValueError("the session is closed")
        kind, value = _prompt(input)
        if kind == "text":
            self._requests.put(pb.ConverseRequest(input_text=value))
        elif kind == "ids":
            self._requests.put(pb.ConverseRequest(input=pb.TokenIds(ids=value)))
        else:
            self._requests.put(pb.ConverseRequest(input_segments=value))
        self._requests.put(pb.ConverseRequest(end_turn=pb.EndTurn(max_new_tokens=max_new_tokens)))
        try:
            for response in self._responses:
                if response.HasField("tokens"):
                    yield _chunk(response.tokens, self._codebooks)
                else:
                    yield _finished(response.turn_finished, turn=response.turn_finished.turn)
                    return
        except grpc.RpcError as e:
            raise M3ServeError(e.code(), e.details()) from None
        raise M3ServeError(grpc.StatusCode.UNKNOWN, "the session ended before the reply did")

    def close(self) -> None:
        """Ends the session (the client's side closes; the server ends the stream)."""
        if self._closed:
            return
        self._closed = True
        self._requests.put(Session._END)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.OK:
                raise M3ServeError(e.code(), e.details()) from None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _prompt(prompt: Prompt):
    if isinstance(prompt, str):
        return "text", prompt
    items = list(prompt)
    if all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        return "ids", items
    return "segments", to_proto(items)


def _chunk(tokens: pb.Tokens, codebooks: int) -> Chunk:
    return Chunk(ids=tuple(tokens.ids), text=tokens.text,
                 segments=tuple(from_proto(s, codebooks) for s in tokens.segments))


def _finished(f, *, turn: int, request_id: str = "") -> Finished:
    t = f.timings
    return Finished(reason=_REASONS.get(f.reason, "unspecified"), prompt_tokens=t.prompt_tokens,
                    generated_tokens=t.generated_tokens, time_to_first_token_ms=t.time_to_first_token_ms,
                    tokens_per_second=t.tokens_per_second, seed=f.seed, turn=turn, request_id=request_id)
