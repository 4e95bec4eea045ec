"""A command's options, each declared once: as a field of its request dataclass
(``ExtractRequest``, ``AblateRequest``, ``DetectRequest``), made by :func:`option` with its
default, what it accepts (choices, a least value) and its command-line flag. The API's
keyword arguments (:func:`keywords_of`), the CLI's click options (``attngeom.cli``) and the
check of a request (:func:`check_options`) read them from there. Light: no library loads."""

from __future__ import annotations

import dataclasses
import inspect
import string
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass
from typing import Any, TypeVar

from attngeom.errors import InputError

__all__ = ["Accepts", "check_options", "flag", "keywords_of", "option", "refusal", "request_field"]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Accepts:
    """What an option accepts beyond its type: one of ``choices``, or at least ``least``
    (``why``, said with a refusal, tells what they hold); ``flag``: its command-line flag when it is
    not the field's name with dashes."""

    choices: tuple[str, ...] = ()
    least: int | None = None
    why: str = ""
    flag: str | None = None


def option(default: Any = MISSING, *, choices: Sequence[str] = (), least: int | None = None, why: str = "",
           flag: str | None = None, default_factory: Any = MISSING, repr: bool = True) -> Any:
    """A request field that is an option: its ``default`` (or ``default_factory``) and what it
    accepts (:class:`Accepts`)."""
    accepts = Accepts(tuple(choices), least, why, flag)
    return dataclasses.field(default=default, default_factory=default_factory, repr=repr,
                             metadata={"accepts": accepts})


def accepts(field: dataclasses.Field) -> Accepts:
    """What ``field`` accepts (nothing said: anything of its type)."""
    return field.metadata.get("accepts", Accepts())


def flag(field: dataclasses.Field) -> str:
    """The command-line flag of ``field``: ``--context-length`` for ``context_length``."""
    return accepts(field).flag or "--" + field.name.replace("_", "-")


def request_field(request: type, name: str) -> dataclasses.Field:
    """Field ``name`` of the request dataclass ``request``."""
    return next(f for f in dataclasses.fields(request) if f.name == name)


@dataclass(frozen=True)
class _Said:
    """An option as a message names it: ``name=`` to a Python caller, its flag on the command
    line; a format spec is its value (``{dtype:float16}``: ``dtype=float16``, ``--dtype float16``)."""

    words: str
    python: bool

    def __format__(self, value: str) -> str:
        if self.python:
            return f"{self.words}={value}"
        return f"{self.words} {value}" if value else self.words

    def __str__(self) -> str:
        """The option as a noun (``{name!s}``): its name, or its flag."""
        return self.words


def refusal(template: str, request: type, error: type[InputError] = InputError, **values: Any) -> InputError:
    """``error`` in the words of its caller: ``template`` names options of the request
    dataclass ``request`` as ``{name}`` (or ``{name:value}``; ``{name!s}``, the option as a
    noun), said ``name=`` (``name``) to a Python caller and as their flag on the command line (the error's ``command_line``, which the CLI
    prints); ``values`` fill the template's other fields, the same in both."""
    names = {f.name: f for f in dataclasses.fields(request)}
    fields = {key for _, key, _, _ in string.Formatter().parse(template) if key in names}
    python = template.format(**values, **{key: _Said(key, True) for key in fields})
    command_line = template.format(**values, **{key: _Said(flag(names[key]), False) for key in fields})
    return error(python, command_line=command_line if command_line != python else None)


def check_options(request: Any) -> None:
    """Refuse a request option outside its choices or below its least value (None: not given),
    naming it in its caller's words (:func:`refusal`): :class:`InputError`, one line."""
    for field in dataclasses.fields(request):
        said, value = accepts(field), getattr(request, field.name)
        if value is None:
            continue
        if said.choices and value not in said.choices:
            raise refusal(f"{{{field.name}:{{value}}}}: use {{choices}}{{why}}", type(request), value=repr(value),
                          choices=f"{', '.join(said.choices[:-1])} or {said.choices[-1]}", why=said.why)
        if said.least is not None and value < said.least:
            raise refusal(f"{{{field.name}!s}} must be at least {{least}}{{why}} (got {{value}})", type(request),
                          least=said.least, why=said.why, value=value)


def keywords_of(request: type, *, leave: Sequence[str] = ()) -> Callable[[F], F]:
    """Give the decorated function, which takes its request's options as ``**options`` and
    makes its request of them, the keyword arguments of ``request``'s fields (their defaults
    and types, as ``help()`` and ``inspect.signature`` show them) but its own named
    parameters and those in ``leave``. The function itself is kept (no wrapper: a warning's
    stack level still reaches the caller); an unknown keyword is refused by the request."""

    def decorate(function: F) -> F:
        own = inspect.signature(function)
        named = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        taken = {p.name for p in named} | set(leave)
        keywords = [
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type,
                              default=f.default if f.default is not MISSING else f.default_factory())
            for f in dataclasses.fields(request) if f.name not in taken
        ]
        function.__signature__ = own.replace(parameters=[*named, *keywords])
        return function

    return decorate
