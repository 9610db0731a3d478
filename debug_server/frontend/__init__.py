"""The rank-0 frontend, its own process: ``python -m debug_server.frontend``.

* ``app``: the aiohttp application, its routes and the process entry point.
* ``pagekit``: what every page shares: the app's keys, the templates, reading a request and
  answering in the format asked for.
* ``dumps``, ``snapshot``: the periodic dumper and its bounded snapshot file.
* ``hangreport``: the hang watch (a verdict on disk seconds after a rank stalls).
* ``lastcycle``: what the dumper, the hang watch and the metrics cycle saw last (``/metrics``
  is built from it: a scrape asks no rank).
* ``metrics``, ``export``, ``pages_extra``, ``store_keys``: the other pages.
* ``render``, ``lanes``: view-models of the HTML pages; they format an analysis result (its
  table models: ``analysis.tables``), never analyse; ``fetchfacts``: the few facts of an FR
  fetch a page shows beside it, built where the fetch happens.
* ``attach``: attaching to a running job from any machine that reaches its TCPStore.

Imports ``fanout`` to ask the ranks, ``analysis`` for every verdict, ``readers`` to find
ranks in the store and read them from outside, and ``rank`` only for ``rank_capture``'s
``duration`` rule.
"""
