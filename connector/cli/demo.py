"""``mooncake-lookout demo``: the lookup path at work on any machine, in about a minute (most of it starting vLLM).

It starts a real Mooncake master on 127.0.0.1, fills it with cached prefixes of a shared-prefix
workload, starts the lookup servers (in a child process, as in vLLM's worker: vLLM's own
``LookupKeyServer`` and ours) and vLLM's real scheduler, and feeds it requests for a bounded time in five
modes, one after another on the same master and workload: vLLM's own client blocking (``upstream sync``)
and async (``upstream async``), then ours blocking (``ours sync``), async (``ours async``) and async with
the wait budget ``auto`` (``ours auto``). Lookups start at admission. ``/metrics`` (our client's figures)
is served on 127.0.0.1 meanwhile; the run ends with a table of the modes and two lines reading it.
``--workload multi-turn`` feeds conversations whose prompt grows turn by turn instead (our prefix cache
asks the store only for new blocks) and the table adds the prefix cache's figures. ``--keep-running``
leaves ``/metrics`` up for a local Prometheus/Grafana until Ctrl-C. ``--mode`` runs one mode for the
whole duration (a clean series for ``mooncake-lookout advise`` to read); ``--pause-master`` freezes the
master for a while in the middle of each mode's run, to show what a stalled store costs. Known harmless
start-up lines of Mooncake and vLLM are held back (``--verbose`` shows them). Every process it starts is
stopped by pid on exit, Ctrl-C included.

Exit codes: 0 when the demo finished (also when ``--keep-running`` is ended by SIGINT/SIGTERM),
130 when interrupted before the table, 2 when it could not start (the message says why).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

DURATIONS = {"small": 5.0, "default": 10.0}
# --mode names -> (client is ours, lookup_* settings); "all" runs the first five, "budget" only when asked.
MODES: dict[str, tuple[bool, dict[str, Any]]] = {
    "upstream-sync": (False, {"lookup_async": False}),
    "upstream-async": (False, {"lookup_async": True}),
    "sync": (True, {"lookup_async": False}),
    "async": (True, {"lookup_async": True}),
    "auto": (True, {"lookup_async": True, "lookup_wait_us": "auto"}),
    "budget": (True, {"lookup_async": True}),  # lookup_wait_us from --budget-us
}
ALL_MODES = "all"
DEFAULT_MODES = ("upstream-sync", "upstream-async", "sync", "async", "auto")
SHARED_PREFIX, MULTI_TURN = "shared-prefix", "multi-turn"
# Per workload: blocks of a prompt (multi-turn: of its context), and new requests per step.
PROMPT_BLOCKS = {SHARED_PREFIX: 8, MULTI_TURN: 2048}
RATES = {SHARED_PREFIX: 4, MULTI_TURN: 1}


def parse_duration(text: str) -> float:
    """Seconds of load in all (split across the modes run): a number, ``small`` (5) or ``default`` (10)."""
    if text in DURATIONS:
        return DURATIONS[text]
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--duration must be seconds or one of {sorted(DURATIONS)}, got {text!r}") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"--duration must be > 0 and <= 3600 seconds, got {text!r}")
    return value


def parse_pause(text: str) -> float:
    """Seconds to freeze the master in each mode's run: 0 (never) up to 600."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 600:
        raise argparse.ArgumentTypeError(f"--pause-master must be seconds from 0 to 600, got {text!r}")
    return value


def _positive(text: str) -> int:
    """A whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def add_demo_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand; returns its parser."""
    p = subparsers.add_parser("demo", help="run the lookup path on a real master and vLLM's scheduler",
                              description=__doc__.split("\n\n")[1])
    p.add_argument("--duration", type=parse_duration, default=DURATIONS["default"], metavar="SECONDS",
                   help="seconds of load in all, split across the modes run; or 'small' (5) / 'default' (10)")
    p.add_argument("--mode", choices=(*MODES, ALL_MODES), default=ALL_MODES,
                   help="run only this lookup mode, for the whole duration: upstream-sync, upstream-async (vLLM's "
                        "own client), sync, async, auto or budget (ours; budget waits --budget-us). Default: the "
                        "first five in turn")
    p.add_argument("--pause-master", type=parse_pause, default=0.0, metavar="SECONDS",
                   help="freeze the Mooncake master (SIGSTOP) for SECONDS in the middle of each mode's run: "
                        "a stalled store (default 0: never)")
    p.add_argument("--port", type=int, default=0, help="port of /metrics on 127.0.0.1 (default 0: any free port)")
    p.add_argument("--workload", choices=(SHARED_PREFIX, MULTI_TURN), default=SHARED_PREFIX,
                   help=f"{SHARED_PREFIX} (default): short prompts sharing a few prefixes; {MULTI_TURN}: "
                        "conversations whose prompt grows turn by turn (our prefix cache asks the store only for "
                        "new blocks; the table then shows its figures)")
    p.add_argument("--rate", type=_positive, default=None, metavar="N",
                   help=f"new requests per scheduler step (default {RATES[SHARED_PREFIX]}; "
                        f"{MULTI_TURN}: {RATES[MULTI_TURN]})")
    p.add_argument("--prompt-blocks", type=_positive, default=None, metavar="N",
                   help=f"blocks of 16 tokens per prompt (default {PROMPT_BLOCKS[SHARED_PREFIX]}; half of them a "
                        f"shared prefix); {MULTI_TURN}: of its context (default {PROMPT_BLOCKS[MULTI_TURN]}: "
                        "32k tokens)")
    p.add_argument("--prefixes", type=int, default=4, metavar="N", help="distinct shared prefixes (default 4)")
    p.add_argument("--prompts", "--requests", dest="prompts", type=int, default=2048, metavar="N",
                   help="distinct prompts, cached in the store before the run (default 2048)")
    p.add_argument("--turns", type=_positive, default=20, metavar="N",
                   help=f"{MULTI_TURN}: turns of a conversation (default 20)")
    p.add_argument("--turn-blocks", type=_positive, default=16, metavar="N",
                   help=f"{MULTI_TURN}: blocks of 16 tokens each turn adds (default 16: 256 tokens)")
    p.add_argument("--conversations", type=_positive, default=8, metavar="N",
                   help=f"{MULTI_TURN}: conversations going on at once, their turns taken in turn (default 8)")
    p.add_argument("--budget-us", type=int, default=200, metavar="US",
                   help="lookup_wait_us of --mode budget (default 200)")
    p.add_argument("--timeout-ms", type=float, default=None, metavar="MS",
                   help="lookup_timeout_ms of our modes (default: the connector's auto)")
    p.add_argument("--model-step-ms", type=float, default=1.5, metavar="MS",
                   help="time a model step takes, between two scheduler steps (default 1.5)")
    p.add_argument("--engine", action="store_true", help="real vllm serve engines on CPU instead (vLLM's CPU build "
                   "in the engine venv, a tiny model): ours vs upstream's connector over HTTP (cli/demo_engine.py)")
    p.add_argument("--keep-running", action="store_true",
                   help="after the table, keep /metrics up until Ctrl-C (for a local Prometheus/Grafana)")
    p.add_argument("--verbose", action="store_true",
                   help="show every log line, the known harmless start-up lines of Mooncake and vLLM included "
                        "(docs/troubleshooting.md)")
    p.set_defaults(func=run_demo)
    return p


class Progress:
    """One line of progress: rewritten in place on a terminal, a plain line per second otherwise."""

    def __init__(self, out: TextIO, every_s: float = 1.0) -> None:
        self.out = out
        self.tty = out.isatty()
        self.every_s = every_s
        self._last = 0.0

    def show(self, text: str, force: bool = False) -> None:
        """Print ``text`` if a second has passed since the last line (or ``force``)."""
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        if self.tty:
            self.out.write("\r" + text.ljust(100))
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def done(self) -> None:
        """End the in-place line."""
        if self.tty:
            self.out.write("\n")
            self.out.flush()


def mode_label(name: str, budget_us: int) -> str:
    """The table's label of ``--mode`` name ``name``: ``upstream sync``, ``ours auto``, ``ours budget 200us``."""
    if name.startswith("upstream-"):
        return name.replace("-", " ")
    return f"ours budget {budget_us}us" if name == "budget" else f"ours {name}"


def demo_modes(budget_us: int, only: str = ALL_MODES, timeout_ms: float | None = None) -> list[Any]:
    """The modes the demo runs: the first five of :data:`MODES` (vLLM's client and ours), or ``only`` one.

    They are bench scenario (c)'s modes, run by the same code (:func:`~mooncake_lookout.connector.bench.sched.
    run_mode`): upstream's rows drive vLLM's own ``MooncakeStoreConnector`` and ``LookupKeyClient``."""
    from mooncake_lookout.connector.bench.sched import mode

    names = DEFAULT_MODES if only == ALL_MODES else (only,)
    out = []
    for name in names:
        ours, config = MODES[name]
        if name == "budget":
            config = {**config, "lookup_wait_us": budget_us}
        if ours and timeout_ms is not None:
            config = {**config, "lookup_timeout_ms": timeout_ms}
        out.append(mode(mode_label(name, budget_us), ours, **config))
    return out


class StepClock:
    """Seconds since a mode's first scheduler step: what the progress line and the master's pause count.

    The scheduler's start-up (seconds, the first time) happens before the first step and is not counted."""

    def __init__(self) -> None:
        self._first: float | None = None

    def tick(self) -> float:
        """Seconds since the first tick (0.0 at the first)."""
        now = time.monotonic()
        if self._first is None:
            self._first = now
        return now - self._first


class MasterPause:
    """Freezes the master from ``start_s`` to ``start_s + seconds`` of a run, judged at each step; always thaws.

    Checked from the scheduler loop's step callback, so no thread of its own: the pause starts and ends at
    the first step past each mark.
    """

    def __init__(self, master: Any, start_s: float, seconds: float, say: Callable[[str], None]) -> None:
        self.master = master
        self.start_s = start_s
        self.end_s = start_s + seconds
        self.say = say
        self.paused = False
        self.done = seconds <= 0

    def at(self, elapsed_s: float) -> None:
        """Pause or resume the master as ``elapsed_s`` (seconds into the run) passes the marks."""
        if self.done:
            return
        if not self.paused and elapsed_s >= self.start_s:
            self.master.pause()
            self.paused = True
            self.say(f"master pid {self.master.pid} paused (SIGSTOP) for {self.end_s - self.start_s:g} s")
        if self.paused and elapsed_s >= self.end_s:
            self.resume()

    def resume(self) -> None:
        """Thaw the master if this pause froze it (idempotent)."""
        if self.paused:
            self.master.resume()
            self.paused = False
            self.done = True
            self.say(f"master pid {self.master.pid} resumed")


def _install_stop_handlers(stop: threading.Event) -> Callable[[], None]:
    """SIGINT/SIGTERM set ``stop`` (work ends at the next step; finally blocks clean up); returns a restorer."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in saved:
        signal.signal(sig, lambda *_: stop.set())

    def restore() -> None:
        for sig, handler in saved.items():
            signal.signal(sig, handler)

    return restore


def run_demo(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the demo, printing to ``out`` (default stdout); returns the exit code (see the module doc)."""
    from mooncake_lookout.connector.rigs.console import Console

    out = out if out is not None else sys.stdout
    console = Console(verbose=args.verbose, level="WARNING").install()  # before vLLM is imported
    stop = threading.Event()
    restore = _install_stop_handlers(stop)
    try:
        if getattr(args, "engine", False):
            from mooncake_lookout.connector.cli.demo_engine import run_engine_demo
            from mooncake_lookout.connector.rigs.machine import CHECKOUT

            return run_engine_demo(args, out, stop, CHECKOUT)
        return _run(args, stop, out, console)
    finally:
        restore()


def _workload(args: argparse.Namespace) -> tuple[Any, dict[str, Any], str]:
    """The workload the flags ask for, the scheduler's sizing for it, and a line that says what it is."""
    from mooncake_lookout.connector.bench.conversations import ConversationStream, Shape
    from mooncake_lookout.connector.bench.sched import Workload

    blocks = args.prompt_blocks or PROMPT_BLOCKS[args.workload]
    if args.workload == SHARED_PREFIX:
        # Each request ends in a block of its own: requests recur over the prompts, and one vLLM has computed
        # whole is answered with no lookup (nothing for the demo to show).
        return (Workload(prompt_blocks=blocks, num_prefixes=args.prefixes, fill=args.prompts, own_last_block=True),
                {}, f"workload: {SHARED_PREFIX}, {args.prompts} prompts of {blocks} blocks over {args.prefixes} "
                "prefixes, each request's last block its own")
    shape = Shape(blocks, args.turns, args.turn_blocks, args.conversations)
    sizing = {"num_blocks": shape.num_blocks(2 * args.conversations), "max_model_len": shape.max_model_len}
    return (ConversationStream(shape, active=args.conversations), sizing,
            f"workload: {MULTI_TURN}, {args.conversations} conversations at once, each a {blocks}-block context "
            f"(in the store before its first turn) and {args.turns} turns of {args.turn_blocks} blocks; each turn "
            "finds the previous one saved")


def _run(args: argparse.Namespace, stop: threading.Event, out: TextIO, console: Any) -> int:
    from mooncake_lookout.connector.bench.rig import Rig
    from mooncake_lookout.connector.bench.sched import run_mode
    from mooncake_lookout.connector.cli.demo_table import format_table
    from mooncake_lookout.connector.config import LookupConfig
    from mooncake_lookout.connector.events import BackgroundObserver
    from mooncake_lookout.connector.rigs.master import MasterError
    from mooncake_lookout.metrics.exporter import new_registry, serve_metrics
    from mooncake_lookout.metrics.prometheus_sink import PrometheusSink

    def say(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    registry = new_registry()
    sink = PrometheusSink(registry=registry)
    telemetry = BackgroundObserver(sink)  # the scheduler's thread only enqueues
    try:
        endpoint = serve_metrics(args.port, registry=registry)
    except OSError as exc:
        say(f"mooncake-lookout demo: cannot serve /metrics: {exc}")
        return 2
    try:
        say(f"metrics: {endpoint.url}")
        modes = demo_modes(args.budget_us, args.mode, args.timeout_ms)
        upstream = any(not m.ours for m in modes)
        say("starting a Mooncake master, the lookup servers" + (" (vLLM's and ours)" if upstream else "")
            + " and vLLM's scheduler (first start ~15-40 s) ...")
        multi_turn = args.workload == MULTI_TURN
        try:
            workload, sizing, what = _workload(args)
        except ValueError as exc:
            say(f"mooncake-lookout demo: {exc}")
            return 2
        rate = args.rate or RATES[args.workload]
        console.adopt_torch()
        try:
            # Multi-turn: our server keeps the store's epoch (as inside vLLM), so the prefix cache is on; the
            # rig's master leases keys for Mooncake's default 10 s, twice lookup_answer_ttl_ms.
            with console.native():  # Mooncake's client logs its set-up from C++
                rig = Rig(namespace="demo", keep_epoch=multi_turn, upstream_server=upstream).start()
        except (MasterError, RuntimeError) as exc:
            say(f"mooncake-lookout demo: {exc}")
            return 2
        runs = []
        try:
            say(f"Mooncake master pid {rig.master.pid} on {rig.master.rpc_address} "
                f"(its metrics: {rig.master.metrics_url}/metrics); lookup servers pid {rig.servers.pid}")
            say(what)
            if multi_turn:
                ttl_ms = LookupConfig().lookup_answer_ttl_ms
                say(f"prefix cache: found blocks remembered for lookup_answer_ttl_ms ({ttl_ms:g} ms), within the "
                    f"master's key lease ({rig.kv_lease_ttl_ms} ms)")
            else:
                say("prefix cache: off in this run (its lookup server keeps no store epoch; inside vLLM it is on), so "
                    "ours asks the store "
                    "for every block of a prompt as vLLM's client does: the table compares the lookup paths alone; "
                    "--workload multi-turn shows the cache on")
            progress = Progress(out)

            def announce(text: str) -> None:
                progress.done()
                say(text)

            per_mode = args.duration / len(modes)
            for m in modes:
                if stop.is_set():
                    break
                if m.ours:  # /metrics carries our client's figures; upstream's client reports none
                    sink.set_config(LookupConfig(lookup_transport=m.transport, **m.extra))
                clock = StepClock()
                pause = MasterPause(rig.master, max(0.0, (per_mode - args.pause_master) / 2), args.pause_master,
                                    announce)

                def on_step(run: Any, label: str = m.label, clock: StepClock = clock,
                            pause: MasterPause = pause) -> None:
                    elapsed = clock.tick()
                    pause.at(elapsed)
                    progress.show(f"[{label:18}] {elapsed:4.1f}/{per_mode:.1f} s  steps {run.steps:6d}  "
                                  f"lookup time/step {1e6 * sum(run.blocked_per_step) / max(1, run.steps):8.1f} us",
                                  force=run.steps == 1)  # each mode's first step: the clock starts there

                try:
                    keys_before = rig.servers.store_counts()[1]
                    runs.append(run_mode(rig, workload, m, arrivals_per_step=rate, steps=None,
                                         seconds=per_mode, model_step_s=args.model_step_ms / 1e3,
                                         observers=[telemetry] if m.ours else [], on_step=on_step,
                                         should_stop=stop.is_set, drain_s=2.0, arrive_in_step=True, **sizing))
                    runs[-1].store_keys = rig.servers.store_counts()[1] - keys_before
                finally:
                    pause.resume()
                progress.show(f"[{m.label:18}] done: {runs[-1].requests} requests in {runs[-1].steps} steps",
                              force=True)
                progress.done()
        finally:
            rig.close()
        if runs:
            say("")
            say(format_table(runs, prefix_cache=multi_turn))
        note = console.summary()
        if note:
            say(note)
        if stop.is_set():
            say("interrupted; every process stopped")
            return 130
        if args.keep_running:
            say(f"/metrics stays up at {endpoint.url}; Ctrl-C to stop")
            stop.wait()
        return 0
    finally:
        endpoint.stop()


__all__ = ["ALL_MODES", "DEFAULT_MODES", "DURATIONS", "MODES", "MULTI_TURN", "MasterPause", "Progress", "SHARED_PREFIX",
           "StepClock", "add_demo_parser", "demo_modes", "mode_label", "parse_duration", "parse_pause", "run_demo"]
