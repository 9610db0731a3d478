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
- ``live``: ``LiveCollector``, the one live collector; ``rounds`` its FR rounds; ``c10d_round``
  and ``c10d_workers`` torch's own C++ workers' two recorders;
- ``agents``: ``AgentRoute``, the route through one agent per host, and ``collector_for``
  (the frontend's collector); ``agentreply`` reads an agent's replies;
- ``pagefirst``: a page's requests before the background polls'; ``fastjson``: orjson where
  installed.
"""
