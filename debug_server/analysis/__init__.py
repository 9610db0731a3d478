"""Analysis: pure functions from per-rank dumps to a verdict, shared by every renderer.

Nothing here touches torch, HTTP or the disk beyond what a caller hands in.

* ``core``: the entry points ``analyze`` (dump dicts) and ``analyze_digests``; the result's shape.
* ``digest``: one rank's dump reduced to a hashable ``RankDigest`` (one pass over its entries).
* ``groups``: which process group (name plus members) each entry belongs to.
* ``merge``: the cross-rank state: ranks with equal digests folded into classes, findings.
* ``match`` (collectives per seq), ``p2p`` (send/recv per peer pair), ``sigcheck`` (do the
  calls agree), ``skew`` (ranks read at different instants are not missing).
* ``verdict``: root-cause order, category, next step, the prose and the banner's headlines.
* ``progress``: last issued/completed seq per communicator and the ranks behind.
* ``stackgroups``: ranks grouped by main-thread position; ``ranks``: ``format_ranks`` (over
  ``protocol.addrs.rank_ranges``).
* ``stackparse``: faulthandler-style stack text to "where is this rank".
* ``tables``: the report's tables (Collectives, NCCL Calls, Groups) and finding lines as models,
  drawn by the text report and the HTML page alike; ``report``: the plain-text renderer.
* ``outliers``, ``wait_counters``, ``profile_merge``: per-rank numbers compared across ranks.
"""
