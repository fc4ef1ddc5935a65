"""Run settings are spelled once (issue 24 §6): the `Settings` struct's fields carry
their flag and help, `evergraph run`'s options are generated from them (and from
cli/options.py for the agent's own), and `evergraph.run()` takes exactly the fields."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from evergraph.engine.settings import Settings, flags, run_keywords


def test_every_setting_but_the_stop_grace_has_one_flag_of_run() -> None:
    from evergraph.cli import main

    by_field = dict(flags())
    assert set(by_field) == set(Settings.__struct_fields__) - {"stop_grace"}
    params = {p.name: p for p in main.run.params}
    given = main.run.make_context("run", []).params  # each parameter's default
    for field, flag in by_field.items():
        opt = params[flag.param]
        assert list(opt.opts) == list(flag.flags), field
        assert opt.help == flag.help, field
        # the flag's default is the field's (an inverted flag: off, the field on)
        default = getattr(Settings(state_dir=Path("/")), field) if field != "state_dir" else None
        if flag.invert:
            assert (given[flag.param], default) == (False, True), field
        else:
            assert given[flag.param] == default, field


def test_run_takes_every_setting_and_names_an_unknown_keyword(tmp_path: Path) -> None:
    from evergraph.agent.api import run

    assert set(run_keywords()) == set(Settings.__struct_fields__) - {"state_dir"}
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_setting'"):
        run(None, state_dir=tmp_path, no_such_setting=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_watch'"):
        run(None, state_dir=tmp_path, no_watch=True)  # the flag's name, not the setting's


def test_run_validates_its_settings_as_the_struct_does(tmp_path: Path) -> None:
    from evergraph.agent.api import run

    g = tmp_path / "g.yaml"
    g.write_text("resources:\n  noop:\n  - name: n\n")
    # a bad value is an input error (status 2), as the CLI's
    assert run(g, state_dir=tmp_path / "s", world=None, converged_timeout=-1) == 2
    assert run(g, state_dir=tmp_path / "s", world=None, repair_backoff_max=float("nan")) == 2


def test_settings_are_frozen_and_keyword_only(tmp_path: Path) -> None:
    s = Settings(state_dir=tmp_path, noop=True)
    with pytest.raises(AttributeError):
        s.noop = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        Settings(tmp_path)  # type: ignore[misc]
    assert msgspec.structs.replace(s, noop=False).noop is False


def test_the_cli_parameters_map_onto_the_settings() -> None:
    from evergraph.cli.options import DEFAULTS, SETTINGS_PARAMS

    for param, (field, invert) in SETTINGS_PARAMS.items():
        assert param in DEFAULTS
        assert field in Settings.__struct_fields__
        assert invert == ("no_" in param), param


def test_the_settings_flags_are_read_without_compiling_their_annotations() -> None:
    """`flags()` runs in every `evergraph run`'s start-up (cli/options.py): as strings
    (`from __future__ import annotations`) each annotation was compiled there, ~1 ms
    (issue 28)."""
    assert not [f for f, a in Settings.__annotations__.items() if isinstance(a, str)]
    assert flags()  # and they are read from the evaluated annotations
