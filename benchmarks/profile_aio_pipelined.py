"""Where the CPU of an asyncio dual write goes: the event loop's thread, thread hops and wake-ups per request.

Runs one variant of ``bench_aio_pipelined.py`` (``async pipelined``: ``AsyncWriterPool(pipelined=True)``;
``async non-atomic``: an ``AsyncSession`` COMMIT then a plain ``AIOProducer`` transaction;
``async non-atomic k2pc``: the same with a kafka2pc ``AsyncTwoPhaseCommitProducer``) at ``C``
concurrent requests over ``W`` transactional ids for a few seconds, and prints per request:

* the CPU of the whole process and of the event loop's thread (``time.thread_time`` there);
* the loop's iterations (``_run_once``) and the callbacks other threads handed it
  (``call_soon_threadsafe``: a thread hop back to the loop each);
* with ``--profile``, the loop thread's top functions (cProfile, its CPU time as the timer);
* with ``--by-greenlet``, the loop thread's CPU split by where it ran: the event loop and the
  coroutines (the main greenlet), or the sync code of a greenlet, named by the function it started
  with (the recipe's scope task, a ``produce``, SQLAlchemy's ``AsyncSession`` calls).

Run::

    python benchmarks/profile_aio_pipelined.py --variant "async pipelined" --concurrency 16 --ids 4 --profile

Kafka: ``$KAFKA_BOOTSTRAP_SERVERS`` or the local broker (started if needed).
PostgreSQL: ``$KAFKA2PC_PG_ADMIN_URL`` (a fresh database is created and dropped).  Prints only;
records nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import threading
import time
from typing import Any

from bench_aio_pipelined import VARIANTS, Bench, _bootstrap  # noqa: E402 - benchmarks/ is on sys.path

from kafka2pc.testing.postgres import fresh_database


class _GreenletClock:
    """The loop thread's CPU time per greenlet kind, measured at every switch (``greenlet.settrace``)."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.started: dict[str, int] = {}
        self._since = 0.0
        self._names: dict[int, str] = {}
        self._thread = 0

    def start(self) -> None:
        import greenlet

        self._thread = threading.get_ident()
        self._since = time.thread_time()
        greenlet.settrace(self._switch)

    def stop(self) -> None:
        import greenlet

        greenlet.settrace(None)

    def _name(self, g: Any) -> str:
        """Named by the bottom frame of its stack, seen when it first switches out (cached by id)."""
        if g.parent is None:
            return "event loop and coroutines (main greenlet)"
        name = self._names.get(id(g))
        if name is None:
            frame = g.gr_frame
            if frame is None:
                return "greenlets that ended without waiting"
            while frame.f_back is not None:
                frame = frame.f_back
            code = frame.f_code
            name = f"{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename.rsplit('/', 2)[-1]})"
            self._names[id(g)] = name
            self.started[name] = self.started.get(name, 0) + 1
        return name

    def _switch(self, event: str, args: Any) -> None:
        if threading.get_ident() != self._thread or event not in ("switch", "throw"):
            return
        origin, _target = args
        now = time.thread_time()
        where = self._name(origin)
        self.cpu[where] = self.cpu.get(where, 0.0) + now - self._since
        if origin.dead:
            self._names.pop(id(origin), None)
        self._since = time.thread_time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=VARIANTS, default="async pipelined")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent requests (tasks)")
    parser.add_argument("--ids", type=int, default=4, help="transactional ids (pool size, or plain producers)")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of the measured run")
    parser.add_argument("--profile", action="store_true", help="cProfile the loop thread and print the top entries")
    parser.add_argument("--by-greenlet", action="store_true",
                        help="split the loop thread's CPU by greenlet (the function each one started with)")
    parser.add_argument("--sort", default="tottime", help="pstats sort key (cumulative, tottime)")
    parser.add_argument("--top", type=int, default=40, help="entries printed")
    args = parser.parse_args()

    with fresh_database() as url:
        bench = Bench(url, _bootstrap(), args.ids, args.concurrency)
        try:
            bench.open_pools(args.ids)
            bench.run_variant(args.variant, args.concurrency, args.ids, 1.0, f"{bench.run_id}-warm")
            loop: Any = bench.loop
            counts = {"iterations": 0, "threadsafe": 0}
            run_once, threadsafe = loop._run_once, loop.call_soon_threadsafe

            def counted_run_once() -> None:
                counts["iterations"] += 1
                run_once()

            def counted_threadsafe(*a: Any, **k: Any) -> Any:
                counts["threadsafe"] += 1
                return threadsafe(*a, **k)

            loop._run_once, loop.call_soon_threadsafe = counted_run_once, counted_threadsafe
            profile = cProfile.Profile(time.thread_time) if args.profile else None
            by_greenlet = _GreenletClock() if args.by_greenlet else None
            cpu0, loop0 = time.process_time(), time.thread_time()
            if profile is not None:
                profile.enable()
            if by_greenlet is not None:
                by_greenlet.start()
            rate = bench.run_variant(args.variant, args.concurrency, args.ids, args.seconds, f"{bench.run_id}-run")
            if profile is not None:
                profile.disable()
            if by_greenlet is not None:
                by_greenlet.stop()
            cpu, loop_cpu = time.process_time() - cpu0, time.thread_time() - loop0
            del loop._run_once, loop.call_soon_threadsafe
            if args.variant == "sync pipelined":
                loop_cpu = 0.0
            n = max(1.0, rate * args.seconds)
            print(f"{args.variant}, {args.concurrency} requests, {args.ids} ids: {rate:.1f} txn/s; per request: "
                  f"process CPU {1000 * cpu / n:.3f} ms, loop thread CPU {1000 * loop_cpu / n:.3f} ms, "
                  f"loop iterations {counts['iterations'] / n:.1f}, call_soon_threadsafe {counts['threadsafe'] / n:.1f}"
                  + (" (cProfile on: inflated)" if profile is not None else ""))
            if by_greenlet is not None:
                for where, seconds in sorted(by_greenlet.cpu.items(), key=lambda item: -item[1]):
                    print(f"  {1000 * seconds / n:7.3f} ms  {by_greenlet.started.get(where, 0) / n:5.2f} greenlets  {where}")
            if profile is not None:
                out = io.StringIO()
                stats = pstats.Stats(profile, stream=out)
                stats.sort_stats(args.sort).print_stats(args.top)
                print(f"times below are seconds over the run: divide by {n:.0f} for per-request")
                print(out.getvalue())
            bench.close_pools()
        finally:
            bench.close()


if __name__ == "__main__":
    main()
