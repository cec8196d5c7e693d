"""The task suite: generators, metrics, runner, report and plots (``kvlocks eval``)."""
