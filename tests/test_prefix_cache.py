"""Prefix-cache hit rates from ``vllm serve``'s counters (``lit_grpo.engines.remote.prefix_cache``)."""

from __future__ import annotations

import pytest

from lit_grpo.engines.remote.prefix_cache import PrefixCacheMeter, counter_growth, prefix_cache_counters


def exposition(hits: float, queries: float, engines: int = 1) -> str:
    """``GET /metrics`` as vLLM 0.32 writes these counters (one label set per engine), among other metrics."""
    lines = ["# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.",
             "# TYPE vllm:prefix_cache_queries counter"]
    for engine in range(engines):
        lines += [f'vllm:prefix_cache_queries_total{{engine="{engine}",model_name="m"}} {queries / engines}',
                  f'vllm:prefix_cache_queries_created{{engine="{engine}",model_name="m"}} 1.7e+09',
                  f'vllm:prefix_cache_hits_total{{engine="{engine}",model_name="m"}} {hits / engines}',
                  f'vllm:external_prefix_cache_hits_total{{engine="{engine}",model_name="m"}} 999.0']
    lines += ['vllm:num_requests_running{engine="0",model_name="m"} 0.0', ""]
    return "\n".join(lines)


def test_counters_are_summed_over_engines_and_other_metrics_ignored():
    assert prefix_cache_counters(exposition(30.0, 120.0, engines=2)) == (30.0, 120.0)
    assert prefix_cache_counters('vllm:num_requests_running{engine="0"} 3.0\n') is None
    assert prefix_cache_counters("") is None


def test_growth_between_reads_and_after_a_restart():
    assert counter_growth((10.0, 40.0), (25.0, 100.0)) == (15.0, 60.0)
    # counters that went back: the server restarted, its counts begin again from zero
    assert counter_growth((10.0, 40.0), (3.0, 8.0)) == (3.0, 8.0)


def test_meter_reports_each_server_and_the_whole_since_the_last_read():
    pages = {0: [exposition(0, 0), exposition(30, 40), exposition(30, 40)],
             1: [None, exposition(10, 60), exposition(20, 80)],
             2: ['vllm:num_requests_running{engine="0"} 0.0\n'] * 3}  # a server without the counters
    meter = PrefixCacheMeter(lambda server: pages[server].pop(0), 3)
    assert meter.take() == {}  # the baseline: nothing queried on server 0, server 1 unreadable
    second = meter.take()
    assert second["server_0_prefix_cache_hit_rate"] == pytest.approx(30 / 40)
    assert second["server_1_prefix_cache_hit_rate"] == pytest.approx(10 / 60)  # counted from its first read
    assert second["prefix_cache_hit_rate"] == pytest.approx(40 / 100)
    assert "server_2_prefix_cache_hit_rate" not in second
    # server 0 was asked nothing since: it is left out, and the whole is server 1's
    assert meter.take() == {"server_1_prefix_cache_hit_rate": pytest.approx(10 / 20),
                            "prefix_cache_hit_rate": pytest.approx(10 / 20)}
