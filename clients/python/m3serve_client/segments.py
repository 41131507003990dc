"""Prompts and replies in the model's terms: text, speech unit frames, named controls
and raw ids (the proto's Segment), as plain Python values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence, Tuple, Union

from m3serve_proto import m3serve_pb2 as pb


@dataclass(frozen=True)
class Text:
    """Text for the model's SentencePiece tokenizer; in a reply, whole characters."""

    text: str


@dataclass(frozen=True)
class Units:
    """Speech unit frames: each frame one unit number per codebook, indexed by codebook
    (the server flattens them in the vocabulary's frame order)."""

    frames: Tuple[Tuple[int, ...], ...]

    @staticmethod
    def of(frames: Sequence[Sequence[int]]) -> "Units":
        return Units(tuple(tuple(int(u) for u in frame) for frame in frames))


@dataclass(frozen=True)
class Control:
    """A control token by its vocab.json name ("bos", "end_of_turn", ...)."""

    name: str


@dataclass(frozen=True)
class Ids:
    """Raw token ids."""

    ids: Tuple[int, ...]

    @staticmethod
    def of(ids: Sequence[int]) -> "Ids":
        return Ids(tuple(int(i) for i in ids))


Segment = Union[Text, Units, Control, Ids]


def to_proto(segments: Sequence[Segment]) -> pb.Segments:
    """The Segments message of a prompt or a turn's input."""
    out = pb.Segments()
    for s in segments:
        p = out.segments.add()
        if isinstance(s, Text):
            p.text = s.text
        elif isinstance(s, Units):
            if not s.frames:
                raise ValueError("Units needs at least one frame")
            width = len(s.frames[0])
            if any(len(f) != width for f in s.frames):
                raise ValueError("Units frames must all hold one unit per codebook (equal lengths)")
            p.units.units.extend(u for f in s.frames for u in f)
        elif isinstance(s, Control):
            p.control = s.name
        elif isinstance(s, Ids):
            p.ids.ids.extend(s.ids)
        else:
            raise TypeError(f"not a segment: {s!r} (use Text, Units, Control or Ids)")
    return out


def from_proto(segment: pb.Segment, codebooks: int) -> Segment:
    """A reply segment; `codebooks` splits a units segment into frames."""
    kind = segment.WhichOneof("kind")
    if kind == "text":
        return Text(segment.text)
    if kind == "units":
        units = list(segment.units.units)
        step = max(codebooks, 1)
        return Units(tuple(tuple(units[i:i + step]) for i in range(0, len(units), step)))
    if kind == "control":
        return Control(segment.control)
    return Ids(tuple(segment.ids.ids))
