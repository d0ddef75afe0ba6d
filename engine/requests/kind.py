"""A request kind: the one interface every kind of request is served through.

A kind (label scores, rerank, classify, an item's own likelihood, completions, embeddings;
engine/requests/catalog.py lists them) is one module holding:

- its input: a dataclass of plain values, as a transport received them (`input_type`);
- `plan(input)`: the input validated and laid out as engine requests (`TokenizedRequest`s,
  whose `answer` record says what the device returns for their rows and how the rows fill
  the answer, engine/requests/answers.py); raises `InvalidInput` naming the field, before
  any device work;
- `answer(plan, done)`: what came back for those requests (`Done`, in order) as the kind's
  result.

Every transport (gRPC, HTTP, the in-process `Scorer`, batch files) serves a kind the same way:
map the wire onto its input, `plan`, run the plan's requests on the device loop, `answer`, and
map the result onto the wire. The device loop sees only the `TokenizedRequest`s, never a kind.
A kind that needs nothing of a transport's own (a wire message of its own) is served by the
generic routes as it is: gRPC `Run` and HTTP `POST /v1/run/{kind}` take its input's fields as a
JSON object and answer its result as JSON (`plain`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np
import pydantic

from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.loop.work_unit import WorkUnit
from prefixscore.engine.requests.invalid_input import InvalidInput


@dataclasses.dataclass(frozen=True)
class Done:
    """One engine request's work, come back: its answer as its rows filled it, and the prefix
    tokens the prefix cache served (no prefill ran for them)."""

    answer: np.ndarray
    cached_tokens: int = 0

    @classmethod
    def of(cls, unit: WorkUnit) -> Done:
        """A unit the device loop answered."""
        return cls(unit.reply.answer, unit.reply.cached_tokens)


class Plan(Protocol):
    """A kind's validated request: the engine requests it runs, side by side (a request without
    device work runs nothing and comes back as its empty answer)."""

    @property
    def requests(self) -> Sequence[TokenizedRequest]: ...

    @property
    def prompt_tokens(self) -> int:
        """The tokens the request asked to score, as a plain forward pass of each input sees them."""
        ...


class RequestKind(Protocol):
    """One kind of request (see the module doc)."""

    name: ClassVar[str]
    input_type: ClassVar[type]

    def plan(self, inp: Any) -> Plan: ...

    def answer(self, plan: Any, done: Sequence[Done]) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Served:
    """A request served: its kind's plan, the result, and each engine request's work."""

    plan: Any
    result: Any
    done: tuple[Done, ...]

    @property
    def cached_tokens(self) -> int:
        return sum(d.cached_tokens for d in self.done)

    def usage(self) -> dict[str, int]:
        """The generic routes' usage: every request's prompt tokens, those the cache served, items."""
        requests = self.plan.requests
        return {
            "prompt_tokens": self.plan.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "items": sum(len(r.items) for r in requests),
        }


def to_run(plan: Plan) -> list[TokenizedRequest]:
    """The plan's requests that need the device: those with items or rows of their own prefix."""
    return [r for r in plan.requests if r.needs_device]


def served(kind: RequestKind, plan: Plan, ran: Sequence[Done]) -> Served:
    """The kind's answer from what came back for `to_run(plan)`, in order (a request without device
    work comes back as its empty answer)."""
    came = iter(ran)
    done = tuple(
        next(came) if r.needs_device else Done(r.answer.buffer(r.items, len(r.label_ids))) for r in plan.requests
    )
    return Served(plan, kind.answer(plan, done), done)


def input_of(kind: RequestKind, fields: object) -> Any:
    """A kind's input from a JSON object's fields (the generic routes), each of its declared type; a
    field the input does not have, one it needs and is not given, or one of another type is
    refused by name."""
    if not isinstance(fields, Mapping):
        raise InvalidInput("input", f"must be a JSON object of {kind.name}'s fields")
    declared = {f.name: f for f in dataclasses.fields(kind.input_type)}
    unknown = sorted(set(fields) - set(declared))
    if unknown:
        raise InvalidInput(unknown[0], f"is not a field of {kind.name}; its fields: {', '.join(declared)}")
    missing = [
        name
        for name, f in declared.items()
        if name not in fields and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise InvalidInput(missing[0], "is required")
    try:  # each field's declared type (a field of `object` is the kind's own to check)
        return pydantic.TypeAdapter(kind.input_type).validate_python(dict(fields))
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        name, *inside = first["loc"] or ("input",)
        raise InvalidInput(f"{name}" + "".join(f"[{at}]" for at in inside), first["msg"]) from err


def plain(value: object) -> Any:
    """A kind's result as plain JSON values: dataclasses as objects, arrays and tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
