"""The per-rank side: what each rank runs so that it can be asked questions.

* ``server``: ``start_debug_server`` / ``stop_debug_server`` (the worker thread, registration,
  and spawning the frontend process on rank 0).
* ``worker``: the aiohttp app in a daemon thread that serves stacks and the FR window.
* ``wire``: the ``/handler/<name>`` routes and ``HandlerError``, shared with the host agent.
* ``discovery``: registration of workers in the job's TCPStore, and finding them again.
* ``stacks``, ``sigstack``, ``pyspy``: three ways to get a rank's Python stacks (in-process,
  by signal, from outside with py-spy).
* ``rank_capture``: profiles and wait counters captured on request.

Imports ``recording`` (for the hooks it serves) and ``analysis`` (window cutting, member lists).
"""
