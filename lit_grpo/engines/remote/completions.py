"""A rollout server's answer to ``POST /v1/completions`` read into ``Completion`` groups (``response_groups``):
every field checked, each completion labelled with the weight versions that sampled its tokens and with the server
that answered, and the versions held to what this trainer pushed to that server."""

from __future__ import annotations

from dataclasses import replace

from lit_grpo.engines.base import Completion
from lit_grpo.engines.remote.connection import RouterConnection, ServerConnection
from lit_grpo.engines.remote.request_layout import read_version_spans
from lit_grpo.wire.protocol import ServerError, version_text


def response_groups(server: ServerConnection | RouterConnection, response: dict, num_prompts: int, n: int,
                    pushed_since: bool = False, partial_rollouts: bool = False) -> list[list[Completion]]:
    """The completions of ``response``, ``n`` per prompt in prompt order, each labelled with the versions that
    sampled its tokens. A server that labels none (no ``weight_versions``) is asked for its version after the
    answer, which names the sampler only if no push of this trainer began since the request was sent
    (``pushed_since``), so such an answer is refused when one did. With ``partial_rollouts`` any version this
    trainer began to push to the server is accepted; otherwise only the one it last pushed."""
    where = f"rollout server {server.url}"
    choices = response.get("choices")
    if not isinstance(choices, list) or len(choices) != num_prompts * n:
        got = len(choices) if isinstance(choices, list) else choices
        raise ServerError(f"{where} returned {got} completions for {num_prompts} prompts x n={n}")
    choices = sorted(choices, key=lambda c: c.get("index", -1))
    if [c.get("index") for c in choices] != list(range(num_prompts * n)):
        raise ServerError(f"{where} returned completion indices that are not 0..{num_prompts * n - 1}")
    # through a router any server may have answered: the router's URL says nothing of which
    answered = server.url if isinstance(server, ServerConnection) else None
    versions, unknown = set(), False
    completions = []
    for c in choices:
        ids, logprobs = c.get("token_ids"), (c.get("logprobs") or {}).get("token_logprobs")
        if not isinstance(ids, list) or not isinstance(logprobs, list) or len(ids) != len(logprobs):
            raise ServerError(f"{where} returned a completion without token_ids and one log-prob per token")
        if any(v is None for v in logprobs):
            raise ServerError(f"{where} returned a completion with a missing log-prob")
        if c.get("finish_reason") not in ("stop", "length"):
            raise ServerError(f"{where} did not finish a completion (finish_reason={c.get('finish_reason')!r})")
        labels, lengths = read_version_spans(c.get("weight_versions"), len(ids), where)
        versions.update(labels)
        unknown = unknown or not labels
        completions.append(Completion([int(t) for t in ids], [float(v) for v in logprobs],
                                      truncated=c.get("finish_reason") == "length", versions=labels,
                                      span_lengths=lengths, server=answered))
    if unknown:
        if pushed_since:
            raise ServerError(f"{where} labelled its completions with no weight version (weight_versions) and "
                              "this trainer began a weight push while they were sampled, so which version "
                              "sampled them is unknown; the project's server and vLLM 0.33 label every token")
        if "weight_version" in response:
            version = version_text(response["weight_version"])
        elif isinstance(server, RouterConnection):  # the router does not say which server answered
            version = server.expected_version
        else:
            version = version_text(server.client.get("/weight_info").get("weight_version"))
        versions.add(version)
        completions = [c if c.versions else replace(c, versions=(version,)) for c in completions]
    expected = server.expected_version
    if partial_rollouts and versions <= server.pushed_versions:
        pass  # pushes keep the requests in flight: any version this trainer pushed (the newest may be under way)
    elif expected is None or versions != {expected}:
        if expected is None:
            raise ServerError(f"{where} holds weight version {sorted(map(str, versions))} and this trainer has "
                              "pushed no weights to it yet: WeightSync (the `sync` section) pushes them when "
                              "training starts")
        raise ServerError(f"{where} sampled with weight version {sorted(map(str, versions))}, but this trainer "
                          f"pushed version {expected!r} to it: the server restarted or another trainer pushed "
                          "weights. Resume from the last checkpoint; the resumed run pushes the policy again")
    return [completions[p * n : (p + 1) * n] for p in range(num_prompts)]
