"""What the test modules share (importable as ``harness``).

``tests/`` is on ``sys.path`` while pytest runs (its ``conftest.py`` is not in a
package), so test modules write ``from harness.ports import private_broker``;
children the tests start get it on ``PYTHONPATH`` (:func:`harness.procs.child_env`).

* ``ports``, ``brokers``: the port registry, private brokers, closed ports, a frozen broker;
* ``procs``: the environment of child processes;
* ``dw_crash``, ``adw_crash``: the dual write's crash workers (a zygote forking a child per job) and
  the consistency check; ``crash_matrix``: the matrix both writers run;
* ``env``: a dual-write test's topic, series and tables; ``pool``: the writer pools' engine and id prefixes;
* ``scenario``: the core and asyncio crash scenarios and their ``scenario_factory`` fixture;
* ``acks``: the acknowledged-write log a crash child fsyncs and its check against the database and Kafka;
* ``loop``: event-loop tests (stall bounds, :func:`harness.loop.assert_loop_not_blocked`);
* ``seeds``: the run's seed (``$KAFKA2PC_SEED``) and each randomized test's seed drawn from it;
* ``kafka_judge``: Kafka's own ``TransactionsCommand`` as an independent judge of "nothing left open".
"""
