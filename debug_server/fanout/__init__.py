"""The fan-out: asking every rank's worker (or each host's agent) one question at once.

One room between the processes that ask (``frontend``, ``agent``, ``tools``) and what they ask
over (``protocol.addrs`` for where the workers are, ``readers`` for reading a rank from outside, ``protocol`` for what the wire carries, ``analysis``
for the digests' memo). It never imports ``frontend``, ``agent`` or ``recording``.

- ``transport``: one POST per worker (``fetch_one``, ``fan_out``), ``RankResult``, the HTTP
  clients (``leanhttp`` for plain HTTP, aiohttp for the rest: ``transport``'s docstring says
  why both), ``settle_gc``, per-rank reachability (``RankStates``);
- ``reply``: a reply parsed once (``FrData``; cut to the window or merged on arrival where it
  must be, never encoded again);
- ``collector``: the ``Collector`` protocol every collector implements (the live one, the
  frontend's ``departed.KeepLast``, the viewer's ``DiskCollector``), and the ``Route``
  protocol;
- ``asker``: ``Asker``, the one asker of the ranks (client, slots, timeout, rank states, the
  404 memo, the quiet ranks), handed to the rounds, the outside reads and the route;
- ``live``: ``LiveCollector``, the one live collector, which owns the asker; ``rounds`` its FR
  rounds; ``outside`` its outside reads; ``c10d_round`` and ``c10d_workers`` torch's own C++
  workers' two recorders;
- ``agents``: ``AgentRoute``, the route through one agent per host (it returns what it left,
  never calls the collector), and ``collector_for``
  (the frontend's collector); ``agentreply`` reads an agent's replies;
- ``pagefirst``: a page's requests before the background polls' (JSON goes through
  ``protocol.fastjson``: orjson where installed).
"""
