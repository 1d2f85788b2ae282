"""``python -m lit_grpo configs``: lists the shipped configs with what each runs (and the stack a config is used
in), prints one exactly as shipped, writes a config and its stack as files, and names the known configs when given
an unknown one. The package's copy is the checkout's ``configs/`` here; tests/test_wheel_user.py runs the command
from a wheel install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lit_grpo.cli import configs as configs_command
from lit_grpo.cli.commands import TOOLS, main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
FILES = {str(p.relative_to(CONFIGS).with_suffix("")): p for p in sorted(CONFIGS.rglob("*.yaml"))}


def configs(args: list[str], capsys) -> str:
    main(["configs", *args])
    return capsys.readouterr().out


def test_every_config_file_is_shipped_under_its_name():
    assert TOOLS["configs"] == "lit_grpo.cli.configs"
    shipped = configs_command.shipped()
    assert {"demo_cpu", "gsm8k/base", "gsm8k/v10_i1", "rec/settings/mixed"} <= set(shipped)
    assert set(shipped) == set(FILES)
    assert all(config.text == FILES[name].read_text() for name, config in shipped.items())


def test_the_listing_names_each_config_with_its_first_comment_line(capsys):
    lines = configs([], capsys).splitlines()
    for name, path in FILES.items():
        first = path.read_text().splitlines()[0].lstrip("#").strip()
        (line,) = [line for line in lines if line.split(" ", 1)[0] == name]
        assert first in line, (name, line)


def test_the_listing_says_how_a_stacked_config_is_run(capsys):
    listing = configs([], capsys)
    assert "stacked: gsm8k/base + gsm8k/v10_i1 (a --config each" in listing
    assert "stacked: gsm8k/base + rec/rec_oneside_is + rec/settings/mixed" in listing
    stacks = {name: config.stack for name, config in configs_command.shipped().items()}
    assert stacks["demo_cpu"] == ["demo_cpu"] and stacks["gsm8k/server"][0] == "gsm8k/base"
    for name, stack in stacks.items():  # a usage comment names only configs that ship
        assert set(stack) <= set(FILES) and name in stack, (name, stack)


@pytest.mark.parametrize("written", ["demo_cpu", "demo_cpu.yaml", "configs/demo_cpu.yaml"])
def test_a_name_prints_the_config_as_shipped(written, capsys):
    assert configs([written], capsys) == (CONFIGS / "demo_cpu.yaml").read_text()


def test_a_printed_config_in_a_subfolder_is_valid_yaml(capsys):
    out = configs(["gsm8k/v10_i1"], capsys)
    assert out == (CONFIGS / "gsm8k" / "v10_i1.yaml").read_text()
    assert yaml.safe_load(out)["sync"]


def test_an_unknown_name_is_one_error_line_naming_it_and_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["configs", "demo_gpu"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("error: unknown config 'demo_gpu'; the shipped configs are: ")
    assert all(name in line for name in FILES) and captured.out == ""


def test_out_writes_the_config_and_its_stack(tmp_path, capsys):
    out = configs(["gsm8k/v10_i1", "--out", str(tmp_path)], capsys)
    base, row = tmp_path / "gsm8k" / "base.yaml", tmp_path / "gsm8k" / "v10_i1.yaml"
    assert base.read_text() == (CONFIGS / "gsm8k" / "base.yaml").read_text()
    assert row.read_text() == (CONFIGS / "gsm8k" / "v10_i1.yaml").read_text()
    assert f"fit --config {base} --config {row}" in out
    configs(["gsm8k/v10_i1", "--out", str(tmp_path)], capsys)  # the same files again: nothing to refuse


def test_out_without_a_name_writes_every_config(tmp_path, capsys):
    configs(["--out", str(tmp_path)], capsys)
    assert {str(p.relative_to(tmp_path).with_suffix("")) for p in tmp_path.rglob("*.yaml")} == set(FILES)


def test_out_never_overwrites_an_edited_config(tmp_path, capsys):
    edited = tmp_path / "demo_cpu.yaml"
    edited.write_text("seed_everything: 7\n")
    with pytest.raises(SystemExit) as exit_:
        main(["configs", "demo_cpu", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert f"{edited} already exist" in capsys.readouterr().err
    assert edited.read_text() == "seed_everything: 7\n"


def test_the_command_imports_neither_torch_nor_lightning():
    code = ("import sys; from lit_grpo.cli.commands import main; main(['configs', 'demo_cpu']); "
            "print(sorted(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules), file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "[]"
