"""The option table (air_magic.options) against @distributed's signature, the magic's
parser and the linter's parser; the settings object (air_magic.settings)."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from air_magic import ConfigurationError, distributed
from air_magic.decorator import DistributedFunction
from air_magic.options import FLAG_TO_OPTION, OPTIONS, OPTIONS_BY_KEYWORD, OptionError, line_parser, unquoted
from air_magic.settings import Settings
from air_magic.spec import LaunchSpec, make_spec

BAD_LINES = ["-n abc", "--foo", "-n", "-h", "--timeout", "-n 2 extra", "--async=1"]
GOOD_LINES = [
    "",
    "-n 2",
    "--num-accelerators=3 --accelerator-type GPU_8xH100 --timeout none",
    "--no-tracking --experiment e --run-name r --async --backend local",
]


def _parameters(func: object) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(func).parameters)  # type: ignore[arg-type]


def test_every_option_is_a_keyword_of_distributed_with_its_default_and_vice_versa() -> None:
    parameters = _parameters(distributed)
    assert set(parameters) == set(OPTIONS_BY_KEYWORD)
    for name, option in OPTIONS_BY_KEYWORD.items():
        parameter = parameters[name]
        assert parameter.default == option.default, name
        kind = inspect.Parameter.KEYWORD_ONLY if option.keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert parameter.kind == kind, name
    # The positional ones in the decorator's order.
    positional = [n for n, p in parameters.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == [o.keyword for o in OPTIONS if o.keyword is not None and not o.keyword_only]


def test_make_spec_and_with_overrides_take_the_same_keywords() -> None:
    assert set(_parameters(make_spec)) == set(OPTIONS_BY_KEYWORD)
    for name, option in OPTIONS_BY_KEYWORD.items():
        assert _parameters(make_spec)[name].default == option.default, name
    # with_overrides: None keeps the current value; remote is refused at decoration only.
    assert set(_parameters(DistributedFunction.with_overrides)) - {"self"} == set(OPTIONS_BY_KEYWORD) - {"remote"}
    # A spec field per option that is not a deprecated name or a refusal.
    fields = set(LaunchSpec.__dataclass_fields__)
    assert fields == set(OPTIONS_BY_KEYWORD) - {"gpus", "gpu_type", "remote"}
    for name in fields:
        assert LaunchSpec.__dataclass_fields__[name].default == OPTIONS_BY_KEYWORD[name].default, name


def test_the_magic_parser_has_the_table_flags_in_order() -> None:
    pytest.importorskip("IPython")
    from air_magic.magics import DistributedMagics

    parser = DistributedMagics.distributed.parser
    actions = [a for a in parser._actions if a.option_strings]
    assert [tuple(a.option_strings) for a in actions] == [o.flags for o in OPTIONS if o.flags]
    assert set(FLAG_TO_OPTION) == {f for a in actions for f in a.option_strings}
    for action in actions:
        option = FLAG_TO_OPTION[action.option_strings[-1]]
        assert action.help == option.help
        assert action.metavar == option.metavar
        assert action.type == option.parse
        assert action.dest == (option.dest or option.flags[-1].lstrip("-").replace("-", "_"))
        if option.action is None:  # a flag with a value stores it under the keyword
            assert action.dest == option.keyword


@pytest.mark.parametrize("line", GOOD_LINES + BAD_LINES)
def test_the_line_parser_reads_a_line_as_the_magic_does(line: str) -> None:
    pytest.importorskip("IPython")
    from IPython.core.error import UsageError

    from air_magic.magics import DistributedMagics

    magic = DistributedMagics.distributed.parser
    try:
        expected: object = vars(magic.parse_args(line.split()))
    except UsageError as exc:
        expected = ("error", str(exc))
    try:
        got: object = vars(line_parser().parse_args(line.split()))
    except OptionError as exc:
        got = ("error", str(exc))
    assert got == expected


def test_the_linter_does_not_import_ipython_or_the_magic() -> None:
    code = (
        "import sys, air_magic.lint.cli\n"
        "from air_magic.lint.notebook import lint_cells\n"
        "lint_cells(['%%distributed -n $N --accelerator-type H100\\nprint(1)', '%%distributed -n x\\n1'])\n"
        "print(sorted(m for m in ('IPython', 'air_magic.magics', 'air_magic.kernel.launcher') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_unquoted_strips_quotes_only_where_the_table_says() -> None:
    assert unquoted(OPTIONS_BY_KEYWORD["accelerator_type"], "'GPU_8xH100'") == "GPU_8xH100"
    assert unquoted(OPTIONS_BY_KEYWORD["run_name"], "'r'") == "'r'"
    assert [o.keyword for o in OPTIONS if o.unquoted] == ["accelerator_type"]


def test_the_panel_keyword_travels_in_the_spec() -> None:
    @distributed(num_accelerators=1, panel=False)
    def quiet() -> None: ...

    assert quiet.spec.panel is False
    assert "panel=False" in repr(quiet)
    assert quiet.with_overrides(num_accelerators=2).spec.panel is False
    assert quiet.with_overrides(panel=True).spec.panel is True
    assert make_spec().panel is None
    with pytest.raises(ConfigurationError, match="^panel must be True, False or None"):
        make_spec(panel="no")


def test_settings_read_the_environment_at_each_use_until_set() -> None:
    environ: dict[str, str] = {}
    settings = Settings(environ)
    assert (settings.capture_warn_mb, settings.panel, settings.panel_mode, settings.warm) == (100.0, True, "auto", True)
    assert (settings.output_limit, settings.stall_seconds, settings.log_limit) == (1 << 20, 300.0, 16 << 20)
    assert (settings.shm_dir, settings.state_dir) == ("/dev/shm", None)
    assert settings.preload.split(",")[0] == "torch"
    assert settings.max_cpu_ranks(2) == (8, False)
    environ.update(
        AIR_MAGIC_CAPTURE_WARN_MB="5",
        AIR_MAGIC_PANEL=" OFF ",
        AIR_MAGIC_WARM="0",
        AIR_MAGIC_OUTPUT_LIMIT="10",
        AIR_MAGIC_MAX_CPU_RANKS="3",
    )
    assert (settings.capture_warn_mb, settings.panel_mode, settings.warm, settings.output_limit) == (
        5.0,
        "off",
        False,
        10,
    )
    assert settings.max_cpu_ranks(2) == (3, True)
    settings.capture_warn_mb = 7  # %config DistributedMagics.capture_warn_mb = 7
    settings.panel = False
    assert (settings.capture_warn_mb, settings.warn_mb, settings.panel) == (7.0, 7.0, False)
    environ["AIR_MAGIC_MAX_CPU_RANKS"] = "0"
    with pytest.raises(ConfigurationError, match="^AIR_MAGIC_MAX_CPU_RANKS must be a whole number"):
        settings.max_cpu_ranks(2)


def test_config_traits_write_into_the_settings() -> None:
    pytest.importorskip("IPython")
    from air_magic import settings as settings_module
    from air_magic.magics import DistributedMagics

    saved = (settings_module.settings._warn_mb, settings_module.settings._panel)
    try:
        magics = DistributedMagics(shell=None)
        magics.capture_warn_mb = 3
        magics.panel = False
        assert settings_module.settings.capture_warn_mb == 3.0
        assert settings_module.settings.panel is False
    finally:
        settings_module.settings._warn_mb, settings_module.settings._panel = saved


def test_modules_that_must_stay_light() -> None:
    code = (
        "import sys, air_magic, air_magic.options, air_magic.settings\n"
        "print(sorted(m for m in ('IPython', 'torch', 'mlflow', 'traitlets') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_pool_s_options_are_the_table_s() -> None:
    """``air_magic.Pool``'s keywords and ``%distributed_pool``'s flags are the table's pool options
    (the line magic has two of its own: --restart and --stop)."""
    pytest.importorskip("IPython")
    from air_magic.magics import DistributedMagics
    from air_magic.options import POOL_KEYWORDS
    from air_magic.pool import Pool

    parameters = _parameters(Pool)
    assert set(parameters) == set(POOL_KEYWORDS) | {"backend"}
    for name in POOL_KEYWORDS:
        default = None if name == "timeout" else OPTIONS_BY_KEYWORD[name].default  # a pool call: no limit
        assert parameters[name].default == default, name
    parser = DistributedMagics.distributed_pool.parser
    flags = [tuple(a.option_strings) for a in parser._actions if a.option_strings]
    table = [o.flags for o in OPTIONS if o.keyword in POOL_KEYWORDS and o.flags]
    assert flags == [("--restart",), ("--stop",), *table]
