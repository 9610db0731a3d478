"""Recording: what runs on the training hot path.

* ``comms``: communicators with hooks over ``torch.distributed`` (``new_comm``), the op
  methods and the op path. Its parts: ``calls`` (the C++ c10d call each op makes), ``records``
  (``OpRecord``, one op's true state), ``work`` (work objects; what a wait orders on CUDA and
  gloo), ``watchdog`` (the one per-process thread: timeouts off the hot path), ``abort`` (the
  abort path of a timeout or failure), ``groups`` (the process group, and which recorder).
* ``hooks``: ``FlightRecorderHook``, the ring buffer of every op a communicator issues.
* ``c10d_fr``: c10d's own Flight Recorder (DDP, FSDP, plain ``torch.distributed``) merged into
  ours, one dump per rank keyed by process group.
* ``lazy``: dumps whose entries are built only when a cut (the live window) keeps them.
* ``stall``: the one rule for when an op counts as stalled, and how it is reported.

Imports only ``debug_server.dumpio`` and torch: no aiohttp, no analysis.
"""
