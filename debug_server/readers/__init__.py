"""Reading a job from outside its ranks: what the frontend, an agent or a worker uses to
read another process of the job.

* ``storeview``: the job's TCPStore read (``StoreRegistry``, ``StaticRegistry``, the lookup, the
  client, ``StoreLane``); the keys are ``protocol.addrs``'s.
* ``jobpids``: which pids a reader may read (the ranks this job announced) and whether they live.
* ``pyspy``: a rank's stacks by py-spy; ``sigstack``: by signal (the capture; the handler is
  ``rank.sigstack``); ``procstate``: a rank's process read from ``/proc``.

Below ``rank`` and ``fanout`` (both read processes from outside: a worker for a peer on its
host, the fan-out for a rank that does not answer); imports only the common modules and
``protocol``.
"""
