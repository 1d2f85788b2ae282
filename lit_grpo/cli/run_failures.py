"""What a fit that started says when its rollout server fails, in one line (``error: ...``, exit status 2, like every
refusal of the command line) instead of Lightning's traceback: :func:`server_failure_line`.

- a server that stopped answering (killed, its machine gone) is named, with the step the fit reached and its last
  checkpoint, and the command that resumes from it (``--ckpt_path last``, :mod:`lit_grpo.cli.resume`);
- a server that refuses the trainer's weights and holds another model than the one this run trains (its
  ``/weight_info`` names it) is named with both models;
- any other error answer is the server's own message, with the step and the last checkpoint.
"""

from __future__ import annotations

from typing import Any

from lit_grpo.wire.protocol import ServerError

#: how much of a server's message the line keeps (a refused push lists every parameter that does not fit)
MAX_DETAIL = 300


def server_error_in(err: BaseException) -> ServerError | None:
    """The :class:`ServerError` ``err`` is or was raised from (its causes and contexts), or None."""
    seen: list[BaseException] = []
    while err is not None and err not in seen:
        if isinstance(err, ServerError):
            return err
        seen.append(err)
        err = err.__cause__ or err.__context__
    return None


def served_models(engine: Any) -> dict[str, str]:  # noqa: ANN401 -- a ServerEngine, or any engine
    """``{url: model}`` of each server of ``engine`` that answers ``/weight_info`` with its model's name."""
    models = {}
    for server in getattr(engine, "servers", None) or []:
        try:
            model = server.client.get("/weight_info").get("model")
        except ServerError:
            continue
        if isinstance(model, str):
            models[server.url] = model
    return models


def last_checkpoint(trainer: Any, resumed_from: str | None) -> str | None:  # noqa: ANN401
    """The checkpoint the fit wrote last (its ``ModelCheckpoint``'s), else the one it resumed from, else None."""
    callback = getattr(trainer, "checkpoint_callback", None)
    written = (getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "")) if callback else ""
    return written or resumed_from or None


def _cut(text: str) -> str:
    return text if len(text) <= MAX_DETAIL else text[: MAX_DETAIL - 3] + "..."


def server_failure_line(err: ServerError, step: int, trained_model: str, urls: list[str], served: dict[str, str],
                        checkpoint: str | None) -> str:
    """The one line for ``err``, raised at optimizer step ``step`` of a fit of ``trained_model`` with the servers
    ``urls``; ``served``: :func:`served_models` after the failure (the servers that still answer);
    ``checkpoint``: :func:`last_checkpoint`."""
    other = {url: model for url, model in served.items() if model != trained_model}
    if other and "push" in str(err):
        url, model = next(iter(other.items()))
        return (f"rollout server {url} holds model {model!r} and this run trains {trained_model!r}: it refused the "
                f"run's weights ({_cut(str(err))}); start the server with --model {trained_model}, or train "
                f"model.model_name {model}")
    resume = (f"rerun this command with --ckpt_path last to resume from the last checkpoint, {checkpoint}"
              if checkpoint else "no checkpoint was written yet: rerun this command")
    gone = [url for url in urls if url not in served]
    if gone:  # it does not answer even now: the server is gone, not one request
        return (f"rollout server {gone[0]} stopped answering at step {step} ({_cut(str(err))}); start it again and "
                f"{resume}")
    return f"the rollout server failed at step {step}: {_cut(str(err))}; {resume}"
