"""Command-line tools that run without a live job.

* ``fr_trace``: analyse a directory of per-rank FR pickles (a drop-in for torch's ``fr_trace``).
* ``view``: the post-mortem viewer, the live pages served from a dump directory (the app and
  the command); ``view_disk`` finds a dump directory's cycles and reads one, and
  ``view_collector`` answers the frontend's handlers from it in place of live ranks.
* ``nccl_log``: read ``NCCL_DEBUG=INFO`` logs of a hung job (the summary, its text and the
  command); ``nccl_log_parse`` turns the lines into per-process state and ranks.
* ``preflight``: network checks before (or during) a hang (setup, each rank's identity, the
  command); ``preflight_net`` times the barriers and the ``all_reduce`` sweep and flags
  stragglers, ``preflight_report`` prints the tables.
* ``envinfo``: the debug-relevant environment of a rank and its known traps.
* ``synthetic``: FR dumps in the recorder's exact schema, for tests and benchmarks.

Each command keeps its documented ``python -m debug_server.<name>`` entry (a two-line module at
the package top that imports ``main`` from here).
"""
