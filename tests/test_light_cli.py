"""``python -m lit_grpo --help`` and ``python -m lit_grpo export|eval|serve|plots`` import only what the command
needs: the list of commands, the tools' ``--help`` and a bad argument answer without torch or Lightning (the time it
takes is measured by hand, not tested here)."""

import subprocess
import sys

import pytest
from cli_runner import probe as run_probe

HEAVY = ("torch", "lightning", "transformers", "jsonargparse")

# runs the dispatcher as `python -m lit_grpo` does, then reports the exit status and which heavy modules loaded


def probe(*args: str, cwd) -> tuple[dict, str, str]:
    return run_probe(list(args), cwd, HEAVY)


@pytest.mark.parametrize("command", ["export", "eval", "serve", "plots"])
def test_help_imports_neither_torch_nor_lightning(command, tmp_path):
    result, out, err = probe(command, "--help", cwd=tmp_path)
    assert result == {"code": 0, "loaded": []}, err[-2000:]
    assert f"python -m lit_grpo {command}" in out or "usage:" in out


@pytest.mark.parametrize("args, expected", [
    (["export", "only_one.ckpt"], ["the following arguments are required: out_dir", "usage:"]),
    (["eval", "--model", "tiny-random-llama", "--ks", "1,x"], ["--ks", "'1,x'"]),
    (["eval", "--model", "tiny-random-llama", "--num_questions", "0"], ["--num_questions must be >= 1, got 0"]),
    (["eval"], ["one of the arguments --model --ckpt is required"]),
])
def test_a_bad_argument_is_one_line_before_torch_loads(args, expected, tmp_path):
    result, _, err = probe(*args, cwd=tmp_path)
    lines = err.strip().splitlines()
    assert result == {"code": 2, "loaded": []}, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for text in expected:
        assert text in lines[0]
    assert lines[0].endswith(f"({' '.join(args)})")


def test_python_m_lit_grpo_dispatches_through_the_light_entry(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lit_grpo", "export", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage: python -m lit_grpo export" in proc.stdout, proc.stderr


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_top_level_help_lists_every_command_before_torch_loads(flag, tmp_path):
    from lit_grpo.cli.commands import COMMANDS, TOOLS

    result, out, err = probe(flag, cwd=tmp_path)
    assert result == {"code": 0, "loaded": []}, err[-2000:]
    assert set(COMMANDS) == {"fit", "validate", "test", "predict", *TOOLS}  # every command is described
    assert {"serve", "eval", "export", "configs", "plots"} <= set(TOOLS)
    for name, what in COMMANDS.items():
        assert f"  {name}  " in out and what in out, name
    assert out.startswith("usage: python -m lit_grpo COMMAND") and "__main__" not in out
    assert "Run inference on your data" not in out  # Lightning's own texts are not the project's
    assert "python -m lit_grpo configs NAME > my.yaml" in out


def test_python_m_lit_grpo_help_names_the_program(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lit_grpo", "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m lit_grpo"), proc.stderr
    assert "__main__" not in proc.stdout


def test_plots_is_a_command(tmp_path):
    result, _, err = probe("plots", str(tmp_path / "no_run"), cwd=tmp_path)
    lines = err.strip().splitlines()
    assert result["code"] == 2 and len(lines) == 1, err
    assert "no TensorBoard event files" in lines[0] and "no_run" in lines[0]


def test_training_subcommands_go_to_lightning_cli(monkeypatch):
    import lit_grpo.cli.commands as commands

    calls = []

    class FakeTraining:
        @staticmethod
        def train(argv):
            calls.append(argv)
            return "cli"

    monkeypatch.setattr(commands.importlib, "import_module",
                        lambda name: FakeTraining if name == commands.TRAINING else None)
    assert commands.main(["fit", "--config", "x.yaml"]) == "cli"
    assert commands.main([]) == "cli"
    assert calls == [["fit", "--config", "x.yaml"], []]


def test_the_training_module_has_no_entry_of_its_own():
    # lit_grpo.cli.lightning_cli.main and run are the dispatcher's, so `cli.main(["export", ...])` runs the tool as
    # before
    from lit_grpo.cli import commands
    from lit_grpo.cli import lightning_cli as cli

    assert cli.main is commands.main and cli.run is commands.run


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_fit_help_is_the_short_list_before_torch_loads(flag, tmp_path):
    from lit_grpo.cli.fit_help import FIT_OPTIONS

    result, out, err = probe("fit", flag, cwd=tmp_path)
    assert result == {"code": 0, "loaded": []}, err[-2000:]
    assert out.startswith("usage: python -m lit_grpo fit") and len(out.splitlines()) < 50
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  --")}
    for option, default, what in FIT_OPTIONS:
        assert option in rows and rows[option].rstrip().endswith(what) and f" {default} " in rows[option], option
    assert "python -m lit_grpo fit --help-all" in out  # the pointer to every option


def test_fit_help_lists_the_parsers_options_in_order_with_its_defaults(tmp_path, monkeypatch, capsys):
    """The short list is written by hand: each option exists in LightningCLI's full help (``fit --help-all``), in
    the same order, and its default is the parser's (``fit --print_config``)."""
    import yaml

    from lit_grpo.cli.commands import main
    from lit_grpo.cli.fit_help import FIT_OPTIONS

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lit_grpo"])
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--help-all"])
    assert exit_.value.code == 0
    full = capsys.readouterr().out
    assert "python -m lit_grpo [options] fit" in full and "--trainer.num_nodes" in full  # not in the short list
    positions = [full.index(f"\n  {option} ") if option != "--config" else full.index("--config CONFIG")
                 for option, _, _ in FIT_OPTIONS]
    assert positions == sorted(positions), "FIT_OPTIONS is not in the parser's order"
    with pytest.raises(SystemExit):
        main(["fit", "--print_config"])
    defaults = yaml.safe_load(capsys.readouterr().out)
    for option, default, _ in FIT_OPTIONS[1:]:  # --config has no default
        node = defaults
        for part in option.removeprefix("--").split("."):
            node = node[part]
        assert node == (yaml.safe_load(default) if default else None), option


def test_every_eval_option_has_a_help_line(tmp_path, monkeypatch, capsys):
    """``fit --help-all`` says what each ``eval.*`` option does, beyond its type and default (LightningCLI reads the
    lines from the callback's docstring, so an option without one shows its type only)."""
    import re

    from lit_grpo.cli.commands import main
    from lit_grpo.cli.option_table import OPTIONS

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lit_grpo"])
    with pytest.raises(SystemExit):
        main(["fit", "--help-all"])
    full = capsys.readouterr().out
    linked = {"eval.system_prompt", "eval.chat_template"}  # set by data.system_prompt / data.chat_template
    keys = [key for key in OPTIONS if key.startswith("eval.") and key not in linked]
    assert all(f"\n  --{key} " not in full for key in linked)
    assert {"eval.max_new_tokens", "eval.problem_column", "eval.prompt_template"} <= set(keys)
    for key in keys:
        block = re.search(rf"\n  --{re.escape(key)}[ ,].*?(?=\n  --|\Z)", full, flags=re.S)
        assert block is not None, key
        text = " ".join(block.group(0).split())
        help_text = text.split(f"--{key}", 1)[1].split("(type:", 1)[0]
        assert len(re.sub(r"[A-Z_\[\],.+{}|]|true|false|ITEM", "", help_text).strip()) > 10, (key, text)
