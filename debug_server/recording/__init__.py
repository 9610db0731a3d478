"""Recording: what runs on the training hot path.

* ``comms``: communicators with hooks over ``torch.distributed`` (``new_comm``), their CUDA
  semantics, timeouts and the one per-process watchdog.
* ``hooks``: ``FlightRecorderHook``, the ring buffer of every op a communicator issues.
* ``c10d_fr``: c10d's own Flight Recorder (DDP, FSDP, plain ``torch.distributed``) merged into
  ours, one dump per rank keyed by process group.

Imports only ``debug_server.dumpio`` and torch: no aiohttp, no analysis.
"""
