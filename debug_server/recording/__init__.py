"""Recording: what runs on the training hot path.

* ``comms``: communicators with hooks over ``torch.distributed`` (``new_comm``) and the op
  path; ``ops`` their op methods. Its parts: ``calls`` (the C++ c10d call each op makes), ``records``
  (``OpRecord``, one op's true state), ``work`` (work objects; what a wait orders on CUDA and
  gloo), ``watchdog`` (the one per-process thread: timeouts off the hot path), ``abort`` (the
  abort path of a timeout or failure), ``groups`` (the process group, and which recorder).
* ``hooks``: ``FlightRecorderHook``, the ring buffer of every op a communicator issues, and the
  whole process's dump (``snapshot``, ``dump_file``: every hook's and c10d's entries). Its
  parts: ``frames`` (each op's Python stack, captured raw, symbolised at dump time),
  ``entries`` (records as FR entries).
* ``c10d_fr``: c10d's own Flight Recorder (DDP, FSDP, plain ``torch.distributed``) read in
  this process; ``c10d_merge`` merges it into ours, keyed by process group (pure). Neither
  imports the hooks.
* ``lazy``: dumps whose entries are built only when a cut (the live window) keeps them.
* ``stall``: the one rule for when an op counts as stalled, and how it is reported.

Imports only the common modules (``config``, ``dumpio``, ``errors``, ``stacks``) and torch: no
aiohttp, no analysis. No cycle among its modules, imports inside functions included.
"""
