"""How a decorated function is called: methods, wrong calls, what travels, where warnings point."""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import cloudpickle
import pytest

from air_magic import CaptureError, ConfigurationError, DirectCallError, distributed
from air_magic.capture import CaptureWarning, cell_payload, function_payload, settings
from air_magic.settings import Settings as _Settings
from air_magic.spec import make_spec


def loads(blob: bytes) -> Any:
    return cloudpickle.loads(blob)


# -- wrong calls name the function -----------------------------------------------------------


@distributed(num_accelerators=2)
def train(lr: float, *, epochs: int = 3) -> float:
    return lr * epochs


@distributed(num_accelerators=2)
def no_arguments() -> None:
    pass


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((1, 2), {}, "train() takes (lr, *, epochs=3): too many positional arguments"),
        ((), {}, "train() takes (lr, *, epochs=3): missing a required argument: 'lr'"),
        ((1,), {"steps": 2}, "train() takes (lr, *, epochs=3): got an unexpected keyword argument 'steps'"),
    ],
)
def test_a_wrong_call_is_a_type_error_naming_the_function(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(TypeError) as info:
        train.distributed(*args, **kwargs)
    assert str(info.value) == message
    assert type(info.value) is TypeError
    assert info.value._render_traceback_() == [f"TypeError: {message}"]  # IPython shows this line alone
    with pytest.raises(TypeError) as info:
        train.submit(*args, **kwargs)
    assert str(info.value) == message


def test_a_function_without_parameters_says_so() -> None:
    with pytest.raises(TypeError) as info:
        no_arguments.distributed(1)
    assert str(info.value) == "no_arguments() takes no arguments: too many positional arguments"


def test_a_function_defined_inside_another_is_named_by_its_own_name() -> None:
    @distributed(num_accelerators=2)
    def inner(x: int) -> int:
        return x

    with pytest.raises(TypeError) as info:
        inner.distributed()
    assert str(info.value) == "inner() takes (x): missing a required argument: 'x'"


def test_decorating_something_that_is_not_a_function_says_what_to_do() -> None:
    with pytest.raises(TypeError) as info:
        distributed(num_accelerators=2)(42)  # type: ignore[arg-type]
    assert str(info.value) == (
        "@distributed decorates a function, got int 42. Put @distributed(...) on the line above a def."
    )


# -- methods ---------------------------------------------------------------------------------


class Trainer:
    def __init__(self, scale: int, resource: Any = None) -> None:
        self.scale = scale
        self.resource = resource

    @distributed(num_accelerators=2)
    def fit(self, epochs: int) -> int:
        return self.scale * epochs


def test_a_method_is_bound_to_its_instance() -> None:
    trainer = Trainer(3)
    bound = trainer.fit
    assert bound.func(2) == 6  # the original method, in this process
    assert bound.num_accelerators == 2
    assert Trainer.fit is Trainer.__dict__["fit"]  # through the class: the decorated object itself
    payload = bound._payload((5,), {})
    func = loads(payload.data["func"])
    args = [loads(blob) for blob in payload.data["args"]]
    assert isinstance(args[0], Trainer) and args[0].scale == 3 and args[1:] == [5]
    assert func(*args) == 15  # what a rank runs
    assert payload.argv == ["fit"]


def test_a_wrong_call_of_a_method_names_the_class_and_leaves_self_out() -> None:
    with pytest.raises(TypeError) as info:
        Trainer(1).fit.distributed()
    assert str(info.value) == "Trainer.fit() takes (epochs): missing a required argument: 'epochs'"


def test_an_instance_that_cannot_travel_is_named_self() -> None:
    with pytest.raises(CaptureError) as info:
        Trainer(1, threading.Lock()).fit._payload((1,), {})
    message = str(info.value)
    assert message.startswith("cannot send 'self' to the ranks: it cannot be pickled.\n")
    assert f"  - self ({__name__}.Trainer): TypeError: cannot pickle '_thread.lock' object" in message


def test_calling_a_decorated_method_directly_names_both_ways() -> None:
    with pytest.raises(DirectCallError, match=r"^fit is decorated with @distributed and cannot be called directly"):
        Trainer(1).fit(2)


def test_the_last_launch_is_shared_by_every_access_of_a_method() -> None:
    trainer = Trainer(1)
    first = trainer.fit
    first.last_launch = "launch-1"
    assert trainer.fit.last_launch == "launch-1"
    assert Trainer.fit.last_launch == "launch-1"
    Trainer.fit.last_launch = None


def test_a_decorated_function_pickles_without_its_last_launch() -> None:
    @distributed(num_accelerators=2, timeout=60)
    def step(x: int) -> int:
        return x + 1

    step.last_launch = threading.Lock()  # like a Launch: it cannot be pickled
    copy = cloudpickle.loads(cloudpickle.dumps(step))
    assert copy.func(1) == 2 and copy.timeout == 60 and copy.last_launch is None
    copy = cloudpickle.loads(cloudpickle.dumps(Trainer.__dict__["fit"]))
    assert copy.num_accelerators == 2


# -- what travels: names in messages -----------------------------------------------------------


def test_a_keyword_argument_is_named_without_nested_quotes() -> None:
    def step(*, lock: Any) -> None:
        pass

    with pytest.raises(CaptureError) as info:
        function_payload(step, (), {"lock": threading.Lock()})
    message = str(info.value)
    assert message.startswith("cannot send 'keyword argument lock' to the ranks: it cannot be pickled.\n")
    assert "  - keyword argument lock (_thread.lock): TypeError" in message


def test_keyword_arguments_still_reach_the_function() -> None:
    payload = train._payload((0.5,), {"epochs": 4})
    func = loads(payload.data["func"])
    kwargs = {k: loads(v) for k, v in payload.data["kwargs"].items()}
    assert kwargs == {"epochs": 4}
    assert func(*[loads(b) for b in payload.data["args"]], **kwargs) == 2.0


# -- the size threshold from the environment ----------------------------------------------------


@pytest.mark.parametrize("text", ["big", "-1", "nan"])
def test_a_bad_capture_threshold_in_the_environment_is_named(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setattr("air_magic.capture.settings", _Settings())
    monkeypatch.setenv("AIR_MAGIC_CAPTURE_WARN_MB", text)
    with pytest.raises(ConfigurationError) as info:
        cell_payload("1", {}, display="Cell In[1]", filename="<c1>")
    assert str(info.value) == (
        f"AIR_MAGIC_CAPTURE_WARN_MB must be a number of megabytes (0 or more), got {text!r}. Set it to "
        "a number such as 500, or unset it for the default of 100."
    )
    with pytest.raises(ConfigurationError, match="^AIR_MAGIC_CAPTURE_WARN_MB must be"):
        train._payload((1,), {})


def test_the_capture_threshold_is_read_from_the_environment_at_each_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = _Settings()
    monkeypatch.setattr("air_magic.capture.settings", fresh)
    monkeypatch.delenv("AIR_MAGIC_CAPTURE_WARN_MB", raising=False)
    assert fresh.warn_mb == 100.0
    monkeypatch.setenv("AIR_MAGIC_CAPTURE_WARN_MB", "1")
    with pytest.warns(CaptureWarning, match="^'blob' is 2 MB once pickled"):
        cell_payload("len(blob)", {"blob": b"x" * 2_000_000}, display="Cell In[1]", filename="<c1>")
    fresh.warn_mb = 50  # %config DistributedMagics.capture_warn_mb = 50 wins over the environment
    assert fresh.warn_mb == 50.0
    assert settings is not fresh


# -- warnings point at the user's line, past IPython's machinery -------------------------------


def _run_as_if_from(filename: str, source: str, namespace: dict[str, Any]) -> None:
    exec(compile(source, filename, "exec"), namespace)


def test_warnings_skip_frames_of_ipythons_machinery() -> None:
    import IPython

    ipython_file = os.path.join(os.path.dirname(os.path.abspath(IPython.__file__)), "core", "magic_like.py")
    namespace = {"make_spec": make_spec}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run_as_if_from(ipython_file, "make_spec(gpus=2)", namespace)
        _run_as_if_from("<decorator-gen-7>", "make_spec(gpus=2)", namespace)
    assert [w.filename for w in caught] == [__file__, __file__]


def test_a_large_capture_warning_points_at_the_caller_through_ipython_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    import IPython

    monkeypatch.setattr(settings, "warn_mb", 1.0)
    ipython_file = os.path.join(os.path.dirname(os.path.abspath(IPython.__file__)), "core", "magic_like.py")
    namespace = {"cell_payload": cell_payload}
    with pytest.warns(CaptureWarning) as record:
        _run_as_if_from(
            ipython_file,
            "cell_payload('len(blob)', {'blob': b'x' * 2_000_000}, display='Cell In[1]', filename='<c1>')",
            namespace,
        )
    assert [w.filename for w in record] == [__file__]
