"""Command-line tools that run without a live job.

* ``fr_trace``: analyse a directory of per-rank FR pickles (a drop-in for torch's ``fr_trace``).
* ``view``: the post-mortem viewer, the live pages served from a dump directory.
* ``nccl_log``: read ``NCCL_DEBUG=INFO`` logs of a hung job.
* ``preflight``, ``envinfo``: network and environment checks before (or during) a hang.
* ``synthetic``: FR dumps in the recorder's exact schema, for tests and benchmarks.

Each keeps its documented ``python -m debug_server.<name>`` entry (a two-line module at the
package top).
"""
