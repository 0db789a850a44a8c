"""Where the CPU of a Django dual write goes: CPU per request of the gunicorn benchmark's views, in one process.

Serves ``benchmarks/_django_bench_app.py`` (the application ``bench_django.py --gunicorn`` runs
under gunicorn) in this process, through its WSGI handler as a gunicorn worker calls it
(middleware, URL resolution, ``request_started``/``request_finished``), against a fresh
PostgreSQL database and the real broker.  ``--threads`` threads post requests (a gthread
worker has 2), for ``--seconds`` per variant and round, the variants interleaved:

* ``nonatomic``: ``POST /nonatomic/<n>`` (the baseline: the rows in one ``transaction.atomic()``,
  then a plain confluent-kafka transaction);
* ``dual``: ``POST /dual/<n>`` (one ``dual_write()``; pipelined unless ``--serial``).  A round
  ends when its last Kafka commit did.

It prints, per variant, requests/s and the CPU per request without the profiler: this
process's (every thread: Django, the pool's background commits and renewals, librdkafka's
threads), the local broker's and the benchmark database's PostgreSQL backends' (medians over
the rounds).  With ``--profile VARIANT``, one more run of that variant under cProfile in every
thread (the timer is each thread's CPU time, ``time.thread_time``), the top functions in
milliseconds per request.  cProfile inflates Python-heavy code: read the shares, not the totals.

Run::

    python benchmarks/profile_django.py [--records 1] [--rounds 3] [--seconds 4]
    python benchmarks/profile_django.py --profile dual --sort tottime --top 40

Kafka: ``$KAFKA_BOOTSTRAP_SERVERS`` or the local broker (started if needed).
PostgreSQL: ``$KAFKA2PC_PG_ADMIN_URL`` (a fresh database is created and dropped).  Prints only;
records nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from _results import merged_profile  # noqa: E402 - benchmarks/ is on sys.path
from bench_dual_write import CpuMeter, _bootstrap  # noqa: E402 - benchmarks/ is on sys.path

from kafka2pc.testing import create_topic
from kafka2pc.testing.postgres import fresh_database


def _environ(path: str) -> dict[str, Any]:
    """A WSGI environ for ``POST path`` with an empty body, as gunicorn builds one."""
    return {
        "REQUEST_METHOD": "POST", "PATH_INFO": path, "SCRIPT_NAME": "", "QUERY_STRING": "",
        "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8000", "SERVER_PROTOCOL": "HTTP/1.1",
        "HTTP_HOST": "127.0.0.1:8000", "CONTENT_LENGTH": "0", "REMOTE_ADDR": "127.0.0.1",
        "wsgi.input": io.BytesIO(b""), "wsgi.errors": sys.stderr, "wsgi.url_scheme": "http",
        "wsgi.version": (1, 0), "wsgi.multithread": True, "wsgi.multiprocess": True, "wsgi.run_once": False,
    }


def _poster(application: Callable[..., Any], path: str) -> Callable[[], None]:
    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        if not status.startswith("201"):
            raise RuntimeError(f"POST {path}: {status}")

    def post() -> None:
        result = application(_environ(path), start_response)
        try:
            for _ in result:
                pass
        finally:
            result.close()  # request_finished: Django's close_old_connections, as gunicorn does

    return post


class Workers:
    """``threads`` long-lived threads posting requests, as a gthread worker's threads (each keeps its Django
    connection, and the dual write its SQLAlchemy pool entry, from one run to the next)."""

    def __init__(self, threads: int) -> None:
        self._start = threading.Barrier(threads + 1)
        self._end = threading.Barrier(threads + 1)
        self._stop = threading.Event()
        self._post: Callable[[], None] | None = None
        self._done = [0] * threads
        self._failed: list[BaseException] = []
        self.profile = False
        """Run under cProfile (each thread's CPU time), into :attr:`profiles`."""
        self.profiles: list[cProfile.Profile] = []
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def _loop(self, i: int) -> None:
        from django.db import connections

        while True:
            self._start.wait()
            post = self._post
            if post is None:
                connections.close_all()
                return
            profile = cProfile.Profile(time.thread_time) if self.profile else None
            if profile is not None:
                profile.enable()
            try:
                while not self._stop.is_set():
                    post()
                    self._done[i] += 1
            except BaseException as exc:  # noqa: BLE001 - reported by run()
                self._failed.append(exc)
            if profile is not None:
                profile.disable()
                self.profiles.append(profile)
            self._end.wait()

    def run(self, post: Callable[[], None], seconds: float, drained: Callable[[], None]) -> int:
        """Every thread calling ``post`` for ``seconds``; then ``drained()``.  Returns the requests done."""
        self._post, self._done[:] = post, [0] * len(self._done)
        self._stop.clear()
        self._start.wait()
        time.sleep(seconds)
        self._stop.set()
        self._end.wait(120)
        drained()
        if self._failed:
            raise self._failed[0]
        return sum(self._done)

    def close(self) -> None:
        self._post = None
        self._start.wait()
        for t in self._threads:
            t.join(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1, help="rows and records per request")
    parser.add_argument("--threads", type=int, default=1, help="threads posting at once (a gthread worker: 2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each variant's run per round")
    parser.add_argument("--pool-size", type=int, default=32, help="POOL_SIZE (the gunicorn benchmark's: 8 x workers)")
    parser.add_argument("--serial", action="store_true", help="the dual write without POOL_OPTIONS['pipelined']")
    parser.add_argument("--profile", choices=("nonatomic", "dual"), help="also profile this variant (cProfile)")
    parser.add_argument("--sort", default="cumulative", help="pstats sort key (cumulative, tottime)")
    parser.add_argument("--top", type=int, default=40, help="entries printed")
    parser.add_argument("--dump", help="also write the profile to this file (pstats format)")
    args = parser.parse_args()

    bootstrap, broker_pids = _bootstrap()
    topic = create_topic(bootstrap, partitions=3)
    load_before = os.getloadavg()[0]
    with fresh_database() as db_url:
        os.environ.update({
            "BENCH_DB_URL": db_url, "BENCH_BOOTSTRAP": bootstrap, "BENCH_TOPIC": topic,
            "BENCH_PREFIX": f"prof-dj-{uuid.uuid4().hex[:6]}", "BENCH_POOL_SIZE": str(args.pool_size),
            "BENCH_PIPELINED": "0" if args.serial else "1",
        })
        import _django_bench_app as app
        from django.core.management import call_command
        from django.db import connection, connections
        from kafka2pc.recipes.django import close
        from kafka2pc.recipes.django._runtime import existing_runtime

        call_command("migrate", verbosity=0)
        with connection.schema_editor() as editor:
            editor.create_model(app.BenchOrder)
        connection.close()

        def drained() -> None:
            runtime = existing_runtime("default")
            if runtime is not None:
                runtime.pool.wait_visible(60)

        n = args.records
        posts = {"nonatomic": _poster(app.application, f"/nonatomic/{n}"),
                 "dual": _poster(app.application, f"/dual/{n}")}
        meter = CpuMeter(broker_pids, sa.make_url(db_url).database or "")
        workers = Workers(args.threads)
        for post in posts.values():  # warm up: connections, producers, the pool's slots
            workers.run(post, 2.0, drained)
        rates: dict[str, list[float]] = {name: [] for name in posts}
        cpu: dict[str, list[tuple[float, float, float]]] = {name: [] for name in posts}
        for r in range(args.rounds):
            order = list(posts.items())
            if r % 2:
                order.reverse()
            for name, post in order:
                before, started = meter.read(), time.perf_counter()
                requests = workers.run(post, args.seconds, drained)
                elapsed, after = time.perf_counter() - started, meter.read()
                rates[name].append(requests / elapsed)
                cpu[name].append(tuple(1000 * (a - b) / requests for a, b in zip(after, before, strict=True)))
        mode = "serial" if args.serial else "pipelined"
        print(f"{n} record(s) per request, {args.threads} thread(s), dual write {mode}, POOL_SIZE {args.pool_size}; "
              f"{args.rounds} rounds of {args.seconds:g} s; load average {load_before:.1f} before, "
              f"{os.getloadavg()[0]:.1f} after; medians (min..max)")
        print(f"{'variant':<10} {'req/s':>8} {'client ms/req':>22} {'broker ms/req':>22} {'postgres ms/req':>22}")
        for name in posts:
            cells = [f"{statistics.median(v):6.3f} ({min(v):.3f}..{max(v):.3f})" for v in zip(*cpu[name], strict=True)]
            print(f"{name:<10} {statistics.median(rates[name]):8.1f} " + " ".join(f"{c:>22}" for c in cells))
        runtime = existing_runtime("default")
        if runtime is not None:
            metrics = runtime.pool.metrics()
            print(f"the pool holds {metrics.leases_held} leases (slots) after "
                  f"{metrics.transactions.transactions_committed} transactions")

        if args.profile:
            _profile(posts[args.profile], args, workers, drained)
        workers.close()
        close()
        connections.close_all()


def _profile(post: Callable[[], None], args: argparse.Namespace, workers: Workers,
             drained: Callable[[], None]) -> None:
    """One more run of ``post`` under cProfile: the posting threads, and every thread of a pool made afresh
    for it (its commit workers and background loops), after a warm-up; the top entries."""
    from kafka2pc.recipes.django import close

    background: list[cProfile.Profile] = []
    lock = threading.Lock()

    def start_profile(*_: object) -> None:  # the first event of a new thread: profile it from there
        profile = cProfile.Profile(time.thread_time)
        with lock:
            background.append(profile)
        profile.enable()

    threading.setprofile(start_profile)
    close()  # the next dual write makes a pool whose threads start under the profiler
    workers.run(post, 2.0, drained)
    with lock:
        for p in background:
            p.clear()  # forget the pool's start and the warm-up
    workers.profile = True
    started = time.perf_counter()
    requests = workers.run(post, args.seconds, drained)
    elapsed = time.perf_counter() - started
    workers.profile = False
    threading.setprofile(None)  # type: ignore[arg-type]
    # The pool's threads end here, their waits returning: a profile snapshot taken from another thread while
    # its thread waits would time the open wait with this thread's clock.
    close()
    with lock:
        taken = workers.profiles + background
    report = merged_profile(taken, args.sort, args.top, args.dump)
    print(f"profiled {args.profile}: {requests / elapsed:.1f} req/s over {len(taken)} threads, {requests} "
          f"requests: times below are seconds over the run, divide by {requests} for per request")
    print(report)

if __name__ == "__main__":
    main()
