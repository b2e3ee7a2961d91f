"""Every exception a user can meet from air_magic shares ``AirMagicError``, so that one
``except air_magic.AirMagicError`` catches what air_magic raises of its own."""

from __future__ import annotations

import inspect

import pytest

import air_magic
import air_magic.data
import air_magic.lint
from air_magic.lint._files import UnreadableFile


def public_exceptions() -> list[type[BaseException]]:
    found = []
    for module in (air_magic, air_magic.data, air_magic.lint):
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isclass(value) and issubclass(value, Exception) and not issubclass(value, Warning):
                found.append(value)
    return found + [UnreadableFile]


def test_the_public_exceptions_are_found() -> None:
    names = {cls.__name__ for cls in public_exceptions()}
    assert {"ConfigurationError", "LaunchError", "DataError", "ConvergenceError", "UnreadableFile"} <= names


@pytest.mark.parametrize("cls", public_exceptions(), ids=lambda cls: cls.__name__)
def test_every_public_exception_is_an_air_magic_error(cls: type[BaseException]) -> None:
    assert issubclass(cls, air_magic.AirMagicError)


def test_convergence_error_is_still_a_runtime_error_with_its_message() -> None:
    error = air_magic.lint.ConvergenceError("train.py", 10, ["AM101", "AM102"])
    assert isinstance(error, RuntimeError)
    assert str(error) == (
        "train.py: fixes did not settle after 10 passes (still changing: AM101, AM102); "
        "nothing was written. Please report this with the file."
    )
