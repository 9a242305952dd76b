"""``mooncake-lookout advise``: the lookup settings a deployment's own metrics support, from its Prometheus.

It reads the lookup path's figures over ``--window`` under ``--selector`` (round trips, deferrals, time the
scheduler spent in lookups per step, outcomes, breaker, pending and held against their bounds, the step
interval; vLLM's own TTFT, queue time and inter-token latency when they are there), prints the mode in
force, what it costs per step and per request, the advised ``lookup_async``, ``lookup_wait_us``,
``lookup_timeout_ms`` and bounds each with the figures behind it (the rules: :mod:`.advise_rules`), and
ready fragments for ``vllm serve --kv-transfer-config`` and for the Helm chart's values; ``--write-values FILE``
writes the latter as the file ``helm upgrade --reuse-values -f FILE`` takes.

Exit codes: 0 advice printed; 2 Prometheus unreachable or a query rejected (bad ``--selector``); 3 no
lookup series under the selector (or several configurations); 4 too little traffic in the window.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, TextIO

from mooncake_lookout.connector.cli.advise_prom import AdviseError, Figures, read_figures, window_seconds
from mooncake_lookout.connector.cli.advise_rules import Advice, Costs, InForce, decide, settings
from mooncake_lookout.connector.cli.prom_http import Access, add_access_args
from mooncake_lookout.connector.plugin import CONNECTOR_NAME

HELM_LOOKUP_PATH = ("engine", "connector", "lookup")  # helm/mooncake-lookout/values.yaml
KV_ROLE = "kv_both"


def _window(text: str) -> str:
    try:
        window_seconds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_advise_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``advise`` subcommand; returns its parser."""
    p = subparsers.add_parser("advise", help="advise lookup_async, lookup_wait_us and bounds from live metrics",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--selector", default="{}", metavar="'{LABEL=\"VALUE\",...}'",
                   help="label matchers of the deployment to advise, e.g. '{namespace=\"prod\",model_name=\"m\"}' "
                        "(default: every series)")
    p.add_argument("--window", type=_window, default="1h",
                   help="how far back to look (a Prometheus duration; default 1h)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the report")
    p.add_argument("--write-values", metavar="FILE", help="also write the advised settings as a Helm values file "
                   "(engine.connector.lookup) for `helm upgrade RELEASE CHART --reuse-values -f FILE`")
    p.add_argument("--timeout-s", type=float, default=10.0, help="deadline of one Prometheus query (default 10)")
    add_access_args(p, required=True)
    p.set_defaults(func=run_advise)
    return p


def kv_transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    """A ``--kv-transfer-config`` with the advised ``kv_connector_extra_config``."""
    return {"kv_connector": CONNECTOR_NAME, "kv_role": KV_ROLE, "kv_connector_extra_config": extra}


def helm_values(extra: dict[str, Any]) -> str:
    """The advised keys as a Helm values fragment (JSON scalars are YAML scalars)."""
    lines = [f"{'  ' * depth}{name}:" for depth, name in enumerate(HELM_LOOKUP_PATH)]
    indent = "  " * len(HELM_LOOKUP_PATH)
    lines += [f"{indent}{k}: {json.dumps(v)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def values_file(f: Figures, advice: list[Advice]) -> str:
    """What ``--write-values`` writes: where the advice comes from, what changed, how to apply it; the values."""
    changed = [f"{a.key} {json.dumps(_plain(a.current))} -> {json.dumps(_plain(a.value))}" for a in advice if a.changed]
    header = [f"# mooncake-lookout advise: the last {f.window} of {f.selector} at {f.url}",
              f"# changed: {'; '.join(changed) or 'nothing (every setting kept)'}",
              "# apply: helm upgrade RELEASE CHART -n NAMESPACE --reuse-values -f THIS_FILE, then run advise again",
              "# with a --window that starts after the rollout"]
    extra = {k: _plain(v) for k, v in settings(advice).items()}
    return "\n".join(header) + "\n" + helm_values(extra)


def _plain(value: Any) -> Any:
    """Whole floats as ints (``100`` rather than ``100.0``) for the fragments."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def report(f: Figures, now: InForce, c: Costs, advice: list[Advice]) -> str:
    """The human report."""
    wait = "?" if now.lookup_wait_us is None else now.lookup_wait_us
    lines = [f"advise: the last {f.window} of {f.selector} at {f.url}",
             f"in force: mode {now.mode} (lookup_async={str(now.lookup_async).lower()}, lookup_wait_us={wait}), "
             f"transport {now.transport}, lookup_timeout_ms={now.timeout_ms:g}, lookup_max_pending={now.max_pending}"]
    if f.configs_in_window > len(f.configs):
        lines.append(f"note: the configuration changed within the window ({f.configs_in_window} seen): the figures "
                     "mix them; re-run with a --window that starts after the change")
    lines += [
        f"traffic: {c.lookups:.0f} lookups in {c.steps:.0f} scheduler steps ({c.lookups_per_step:.2f} per step), "
        f"step interval {_ms(c.step_s)}, of which {_ms(c.base_step_s)} without lookups (what auto's cap is a "
        "share of)",
        f"cost per step: {_ms(c.blocked_per_step_s)} inside the lookup path ({c.blocked_share:.1%} of the step; "
        f"one call p99 {_ms(f.blocked_call_p99_s)})"
        + (f"; wait budget in force {_ms(f.budget_now_s)} (window max {_ms(f.budget_max_s)})"
           if now.lookup_async else ""),
        f"cost per request: {_ms(c.blocked_per_lookup_s)} of scheduler time; deferred {c.deferred_mean:.2f} steps "
        f"(p90 {_num(f.deferred_p90)}, about {_ms(c.deferral_delay_s)} each); submit to answer used "
        f"p50 {_ms(f.delay_p50_s)}, p90 {_ms(f.delay_p90_s)}",
        f"round trip of {c.answered_in_time:.0f} lookups answered by the deadline"
        f"{' (as read: an answer not waited for is read at the next step)' if now.lookup_async else ''}: "
        f"p50 {_ms(c.rpc_p50_s)}, p90 {_ms(c.rpc_p90_s)}, p99 {_ms(c.rpc_p99_s)} (interpolated within "
        f"histogram buckets); {c.near_deadline:.0f} in the last half before the deadline",
        "outcomes: " + (", ".join(f"{n:.0f} {o}" for o, n in sorted(f.outcomes.items()) if n) or "none")
        + ("; the breaker opened" if f.breaker_opened else ""),
    ]
    if f.vllm is not None:
        v = f.vllm
        lines.append(f"vLLM: time to first token p50 {_ms(v.ttft_p50_s)}, p90 {_ms(v.ttft_p90_s)}; queue time p50 "
                     f"{_ms(v.queue_p50_s)}; inter-token latency p50 {_ms(v.itl_p50_s)}")
    else:
        lines.append("vLLM: no vLLM step or latency series under the selector (a standalone client)")
    lines += ["", "advice:"]
    heads = [f"{a.key}: {json.dumps(_plain(a.value))}" for a in advice]
    wases = [f"(was {json.dumps(_plain(a.current))})" if a.changed else "(keep)" for a in advice]
    w1, w2 = max(map(len, heads)), max(map(len, wases))
    for a, head, was in zip(advice, heads, wases):
        lines.append(f"  {head:{w1}}  {was:{w2}}  {a.reason}")
    extra = {k: _plain(v) for k, v in settings(advice).items()}
    lines += ["", "vllm serve:", f"  --kv-transfer-config '{json.dumps(kv_transfer_config(extra))}'",
              "", f"Helm values ({'.'.join(HELM_LOOKUP_PATH)}):"]
    lines += ["  " + line for line in helm_values(extra).splitlines()]
    return "\n".join(lines)


def as_json(f: Figures, now: InForce, c: Costs, advice: list[Advice]) -> dict[str, Any]:
    """The whole advice as one JSON document (seconds for times)."""
    extra = {k: _plain(v) for k, v in settings(advice).items()}
    return {
        "prometheus": f.url, "selector": f.selector, "window": f.window,
        "in_force": vars(now), "configs_in_window": f.configs_in_window,
        "costs": vars(c), "outcomes": f.outcomes,
        "figures": {**{k: v for k, v in vars(f).items()
                       if k not in ("url", "selector", "window", "configs", "vllm", "rpc_buckets")},
                    "rpc_buckets": [["+Inf" if math.isinf(le) else le, n] for le, n in f.rpc_buckets]},
        "vllm": None if f.vllm is None else vars(f.vllm),
        "advice": [{"key": a.key, "value": _plain(a.value), "current": _plain(a.current), "changed": a.changed,
                    "reason": a.reason, "figures": a.figures} for a in advice],
        "kv_transfer_config": kv_transfer_config(extra),
        "helm_values": helm_values(extra),
    }


def run_advise(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Read, decide, print; returns the exit code (see the module doc). Errors are one line on ``err``."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    try:
        figures = read_figures(Access.from_args(args), args.selector, args.window, args.timeout_s)
        now, costs, advice = decide(figures)
    except (AdviseError, ValueError) as e:
        err.write(f"mooncake-lookout advise: {e}\n")
        return e.code if isinstance(e, AdviseError) else 2
    if args.write_values:
        try:
            with open(args.write_values, "w", encoding="utf-8") as file:
                file.write(values_file(figures, advice))
        except OSError as e:
            err.write(f"mooncake-lookout advise: cannot write {args.write_values}: {e.strerror or e}\n")
            return 2
        err.write(f"advise: wrote the advised values to {args.write_values}: helm upgrade RELEASE CHART -n "
                  f"NAMESPACE --reuse-values -f {args.write_values}\n")
    if args.json:
        out.write(json.dumps(as_json(figures, now, costs, advice), indent=2) + "\n")
    else:
        out.write(report(figures, now, costs, advice) + "\n")
    return 0


__all__ = ["HELM_LOOKUP_PATH", "add_advise_parser", "as_json", "helm_values", "kv_transfer_config", "report",
           "run_advise", "values_file"]
