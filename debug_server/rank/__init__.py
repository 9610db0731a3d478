"""The per-rank side: what runs inside each rank so that it can be asked questions.

* ``server``: ``start_debug_server`` / ``stop_debug_server`` (the worker thread, registration,
  and spawning the frontend process on rank 0).
* ``worker``: the aiohttp app in a daemon thread that serves stacks and the FR window (its
  routes are ``protocol.wire``'s).
* ``discovery``: this rank's registration in the job's TCPStore, its address, its peers.
* ``ptracer``: ``PR_SET_PTRACER`` kept on this host's reader; ``sigstack``: faulthandler
  registered for the signal path (read by ``readers.sigstack``).
* ``agent_launch``: starting the host's agent from local rank 0 (it runs in the rank).
* ``rank_capture``: profiles and wait counters captured on request; ``clock``: the rank's clock.

Imports ``recording`` (for the hooks it serves), ``readers`` (py-spy and ``/proc`` for the
worker's ``pyspy_dump`` and ``process_state``), ``analysis`` and ``protocol``.
"""
