"""Analysis: pure functions from per-rank dumps to a verdict, shared by every renderer.

Nothing here touches torch, HTTP or the disk beyond what a caller hands in.

* ``core``: digesting rank dumps, matching collectives and P2P ops across ranks, the verdict.
* ``stackparse``: faulthandler-style stack text to "where is this rank".
* ``frwindow``, ``members``: which FR entries the live analysis needs; member lists sent once.
* ``report``: the plain-text renderer of an analysis result.
* ``outliers``, ``wait_counters``, ``profile_merge``: per-rank numbers compared across ranks.
"""
