"""The ``kvlocks`` command as a user runs it (bundled model, CPU)."""

import json

import pytest

from kvlocks.cli import main

pytestmark = pytest.mark.model


@pytest.mark.parametrize("method", ["locks", "loki"])
def test_generate_json(method, capsys):
    rc = main(["generate", "--method", method, "--budget", "32", "--max-new-tokens", "3",
               "--prompt", "Name a colour.", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["method"] == method and out["config"]["budget"] == 32
    assert out["stats"]["decode_steps"] >= 1 and out["stats"]["pages_selected"] <= 2


def test_bad_arguments_give_clear_errors(capsys):
    assert main(["generate", "--budget", "40", "--prompt", "x"]) == 2
    assert "budget=40" in capsys.readouterr().err
    assert main(["generate", "--prompt", "   "]) == 2
    assert "empty" in capsys.readouterr().err
